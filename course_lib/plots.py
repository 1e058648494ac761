"""Figures used by the notebooks. Each function draws on an Axes and returns it."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch


def _axes(ax, figsize=(6.0, 3.5)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def attention_heatmap(weights, x_labels=None, y_labels=None, ax=None, title: str | None = None, xlabel: str = "key (source position)", ylabel: str = "query (output step)"):
    """Heat map of attention weights (Tq, Tk): rows are queries, columns keys."""
    weights = torch.as_tensor(weights).detach().float()
    ax = _axes(ax, figsize=(0.45 * weights.shape[1] + 1.5, 0.4 * weights.shape[0] + 1.0))
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if x_labels is not None:
        ax.set_xticks(range(len(x_labels)), labels=list(x_labels))
    if y_labels is not None:
        ax.set_yticks(range(len(y_labels)), labels=list(y_labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    return ax


def loss_curves(curves: dict, ax=None, smooth: int = 10, title: str = "training loss"):
    """Plot named loss curves (lists of floats) on a log axis, smoothed by a running mean of ``smooth`` steps."""
    ax = _axes(ax)
    for name, losses in curves.items():
        values = torch.tensor(losses, dtype=torch.float64)
        if smooth > 1 and len(values) >= smooth:
            values = values.unfold(0, smooth, 1).mean(-1)
        ax.plot(values.numpy(), label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title)
    ax.legend()
    return ax


def bar_distribution(probs, labels, ax=None, title: str | None = None):
    """Bar chart of a probability distribution with its labels."""
    probs = torch.as_tensor(probs).detach().double()
    ax = _axes(ax, figsize=(5.0, 2.8))
    ax.bar(range(len(labels)), probs.numpy(), color="tab:blue")
    ax.set_xticks(range(len(labels)), labels=list(labels))
    ax.set_ylim(0, 1)
    ax.set_ylabel("probability")
    if title:
        ax.set_title(title)
    return ax


#: colours of the request states in ``request_timeline`` (chapter 12)
STATE_COLOURS = {"waiting": "#d9d9d9", "prefill": "#4c72b0", "decode": "#55a868", "idle": "#c44e52",
                 "preempted": "#dd8452"}


def request_timeline(states: list, names: list, ax=None, title: str | None = None):
    """One row per request, one column per engine step, coloured by the request's state at that step.

    states: per step, a dict {request name: state} (course_lib.serving.StepLog.states); names: the rows, in order.
    States: waiting (arrived, not running), prefill, decode, idle (done, its batch row still occupied), preempted.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    ax = _axes(ax)
    order = list(STATE_COLOURS)
    grid = torch.full((len(names), len(states)), -1.0)
    for step, at in enumerate(states):
        for row, name in enumerate(names):
            if name in at:
                grid[row, step] = order.index(at[name])
    cmap = ListedColormap(["white"] + [STATE_COLOURS[s] for s in order])
    ax.imshow((grid + 1).numpy(), cmap=cmap, vmin=0, vmax=len(order), aspect="auto", interpolation="nearest")
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.set_yticks([])
    ax.legend(handles=[Patch(color=STATE_COLOURS[s], label=s) for s in order], fontsize=7, loc="upper right", ncol=2)
    if title:
        ax.set_title(title)
    return ax


def block_diagram(cache, tables: dict, ax=None, title: str | None = None):
    """A paged KV cache at one moment (chapter 12): each sequence's block table above the pool it points into.

    cache: a course_lib.serving.PagedKVCache; tables: {sequence name: its block table (block numbers, in order)}.
    Top rows: one box per entry of a block table, the block's number in it. Bottom row: the pool, one box per
    block with its reference count, coloured: held by one sequence, shared (count > 1), free but cached (still
    findable by its hash, hatched), free. Lines join each table entry to its block.
    """
    from matplotlib.patches import Patch, Rectangle

    ax = _axes(ax, figsize=(0.55 * cache.num_blocks + 2.0, 0.5 * len(tables) + 1.6))
    colours = {"held": "#55a868", "shared": "#4c72b0", "free, cached": "#f0e0a0", "free": "white"}

    def state(block):
        refs = cache.refs[block]
        return "shared" if refs > 1 else "held" if refs else "free, cached" if block in cache.hash_of else "free"

    for block in range(cache.num_blocks):
        s = state(block)
        ax.add_patch(Rectangle((block, 0), 0.9, 0.8, facecolor=colours[s], edgecolor="black",
                               hatch="//" if s == "free, cached" else None))
        ax.text(block + 0.45, 0.4, str(cache.refs[block]), ha="center", va="center", fontsize=8)
        ax.text(block + 0.45, -0.3, str(block), ha="center", va="center", fontsize=7, color="grey")
    for row, (name, table) in enumerate(tables.items()):
        y = 1.6 + 1.1 * (len(tables) - 1 - row)
        ax.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=8)
        for i, block in enumerate(table):
            ax.add_patch(Rectangle((i, y), 0.9, 0.8, facecolor=colours[state(block)], edgecolor="black"))
            ax.text(i + 0.45, y + 0.4, str(block), ha="center", va="center", fontsize=8)
            ax.plot([i + 0.45, block + 0.45], [y, 0.8], color="grey", linewidth=0.5)
    ax.set_xlim(-1.6, cache.num_blocks + 0.2)
    ax.set_ylim(-0.6, 1.6 + 1.1 * len(tables))
    ax.axis("off")
    ax.text(-0.3, 0.4, "pool\n(refs)", ha="right", va="center", fontsize=8)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", hatch="//" if s == "free, cached" else None, label=s)
                       for s, c in colours.items()], fontsize=7, loc="upper right", ncol=4)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
