"""The environment check of chapter 00: are the pinned packages installed?"""
from __future__ import annotations

import sys
from importlib import metadata

DISTRIBUTION = "attention-to-decoding"


def pinned_requirements() -> dict[str, str]:
    """{package: pinned version} from the installed course's metadata (pyproject.toml)."""
    pins = {}
    for requirement in metadata.requires(DISTRIBUTION) or []:
        if ";" in requirement:  # environment markers: none today, but do not misread them
            continue
        name, _, version = requirement.partition("==")
        pins[name.strip()] = version.strip()
    return pins


def check_environment() -> bool:
    """Print one line per pinned package (✓ when the installed version is the pinned one); return True if all match."""
    ok = sys.version_info >= (3, 10)
    print(f"{'✓' if ok else '✗'} python {sys.version_info.major}.{sys.version_info.minor} (needs >= 3.10)")
    for name, pinned in pinned_requirements().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        # torch's CPU wheel reports "2.13.0+cpu": the local label is not a different release
        match = installed.split("+")[0] == pinned
        ok &= match
        print(f"{'✓' if match else '✗'} {name} {pinned}" + ("" if match else f" (installed: {installed}; run `make setup`)"))
    return ok
