"""Interactive explorers (ipywidgets). Each returns a widget to display."""
from __future__ import annotations

import base64
import io

import matplotlib.pyplot as plt
import torch

from .plots import bar_distribution


def softmax_of(scores, temperature: float) -> torch.Tensor:
    """softmax(scores / temperature); temperature must be > 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(torch.as_tensor(scores, dtype=torch.float64) / temperature, dim=-1)


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def temperature_explorer(scores, labels, initial: float = 1.0):
    """A slider for the temperature of softmax(scores / T), with the distribution drawn live.

    The text line above the chart ("T = 1.00 → p(mat) = 0.609, ...") changes with the slider.
    The output widget's state is set directly (not captured from stdout), so the explorer
    behaves the same in JupyterLab, under nbval and in any headless kernel.
    """
    import ipywidgets as widgets

    slider = widgets.FloatLogSlider(value=initial, base=10, min=-1, max=1, step=0.05, description="temperature",
                                    readout_format=".2f", continuous_update=True)
    output = widgets.Output()

    def redraw(temperature: float) -> None:
        probs = softmax_of(scores, temperature)
        summary = ", ".join(f"p({label}) = {p:.3f}" for label, p in zip(labels, probs.tolist()))
        figure, ax = plt.subplots(figsize=(5.0, 2.8))
        bar_distribution(probs, labels, ax=ax, title=f"softmax(scores / {temperature:.2f})")
        output.outputs = (
            {"output_type": "stream", "name": "stdout", "text": f"T = {temperature:.2f} → {summary}\n"},
            {"output_type": "display_data", "metadata": {},
             "data": {"image/png": _png(figure), "text/plain": "<distribution chart>"}},
        )

    slider.observe(lambda change: redraw(change["new"]), names="value")
    redraw(initial)
    return widgets.VBox([slider, output])
