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
                                    readout_format=".2f", continuous_update=True, style={"description_width": "initial"})
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


def sampler_explorer(logits, labels, shown: int = 16, **processors):
    """Sliders for temperature, top-k, top-p and min-p over one next-token distribution (V,) logits.

    Draws the `shown` most probable tokens: the model's distribution (grey) and the processed,
    renormalised one that sampling would use (blue), with how many tokens survive and their mass.
    The processors run in course_lib.decoding's order (temperature, top-k, top-p, min-p); processors: other
    versions of them by the name of the function they replace, as for ``decoding.process_logits``
    (``top_k_filter=my_top_k_filter``), e.g. the learner's. Like
    temperature_explorer, the output widget's state is set directly, so it renders headless too.
    """
    import ipywidgets as widgets

    from .decoding import process_logits

    logits = torch.as_tensor(logits, dtype=torch.float32).reshape(1, -1)
    base = torch.softmax(logits[0].double(), dim=-1)
    order = base.argsort(descending=True)[:shown]
    names = [labels[i] for i in order.tolist()]
    labels_fit = {"style": {"description_width": "7em"}}  # the longest label whole, the four sliders aligned
    temperature = widgets.FloatSlider(value=1.0, min=0.05, max=3.0, step=0.05, description="temperature", **labels_fit)
    top_k = widgets.IntSlider(value=0, min=0, max=logits.shape[-1], description="top-k (0 off)", **labels_fit)
    top_p = widgets.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.01, description="top-p", **labels_fit)
    min_p = widgets.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01, description="min-p", **labels_fit)
    output = widgets.Output()

    def redraw(_=None) -> None:
        processed = process_logits(logits, logits.new_zeros(1, 0, dtype=torch.long), temperature=temperature.value,
                                   top_k=top_k.value or None, top_p=top_p.value, min_p=min_p.value or None,
                                   **processors)
        probs = torch.softmax(processed[0].double(), dim=-1)
        kept = int(torch.isfinite(processed).sum())
        figure, ax = plt.subplots(figsize=(7.0, 2.8))
        x = torch.arange(len(names)).numpy()
        ax.bar(x - 0.2, base[order].numpy(), width=0.4, color="0.7", label="model (T = 1)")
        ax.bar(x + 0.2, probs[order].numpy(), width=0.4, color="tab:blue", label="processed, renormalised")
        ax.set_xticks(x, [repr(n)[1:-1] for n in names])
        ax.set_ylabel("probability")
        ax.legend(fontsize=8)
        summary = (f"T = {temperature.value:.2f}, top-k = {top_k.value or 'off'}, top-p = {top_p.value:.2f}, "
                   f"min-p = {min_p.value:.2f} -> {kept} of {logits.shape[-1]} tokens kept, "
                   f"they held {base[torch.isfinite(processed[0])].sum().item():.3f} of the model's mass")
        output.outputs = (
            {"output_type": "stream", "name": "stdout", "text": summary + "\n"},
            {"output_type": "display_data", "metadata": {},
             "data": {"image/png": _png(figure), "text/plain": "<distribution chart>"}},
        )

    for slider in (temperature, top_k, top_p, min_p):
        slider.observe(redraw, names="value")
    redraw()
    return widgets.VBox([temperature, top_k, top_p, min_p, output])


def attention_explorer(maps, labels, scores: dict | None = None, sample: int = 0):
    """Sliders for layer and head over attention maps (L, B, H, T, T): one head's weights drawn as a heat map.

    labels: the T tokens as text (the axes' tick labels); scores: {name: (L, H) tensor}, printed for the head
    shown ("previous-token 0.322, first-token 0.013, ..."); sample: which row of the batch is drawn.
    The output widget's state is set directly, as temperature_explorer's is.
    """
    import ipywidgets as widgets

    maps = torch.as_tensor(maps)
    L, _, H, T, _ = maps.shape
    layer = widgets.IntSlider(value=0, min=0, max=L - 1, description="layer")
    head = widgets.IntSlider(value=0, min=0, max=H - 1, description="head")
    output = widgets.Output()
    shown = [str(label) if str(label).strip() else repr(str(label)) for label in labels]

    def redraw(*_):
        l, h = layer.value, head.value
        summary = ", ".join(f"{name} {float(value[l, h]):.3f}" for name, value in (scores or {}).items())
        figure, ax = plt.subplots(figsize=(5.2, 4.6))
        ax.imshow(maps[l, sample, h].double().numpy(), cmap="Blues", vmin=0, vmax=1)
        ticks = range(0, T, max(1, T // 32))
        ax.set_xticks(list(ticks), [shown[i] for i in ticks], fontsize=6)
        ax.set_yticks(list(ticks), [shown[i] for i in ticks], fontsize=6)
        ax.set_xlabel("key (attended to)"); ax.set_ylabel("query")
        ax.set_title(f"layer {l}, head {h}")
        output.outputs = (
            {"output_type": "stream", "name": "stdout", "text": f"layer {l}, head {h}: {summary}\n"},
            {"output_type": "display_data", "metadata": {},
             "data": {"image/png": _png(figure), "text/plain": "<attention map>"}},
        )

    layer.observe(redraw, names="value")
    head.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([layer, head]), output])
