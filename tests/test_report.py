"""Tables and plots: the colour scale of the heatmaps and the files they write."""

import math

from wushkv.report import color_max, plot_heatmaps


def test_color_max_ignores_runs_not_made_and_falls_back_to_one():
    assert color_max({"a": [[0.1, math.nan], [0.3, 0.2]], "b": [[0.25, math.inf]]}) == 0.3
    assert color_max({"a": [[math.nan]]}) == 1.0
    assert color_max({"a": [[0.0, 0.0]]}) == 1.0


def test_heatmap_uses_the_data_scale_when_asked(tmp_path, monkeypatch):
    import matplotlib.axes

    seen = []
    real = matplotlib.axes.Axes.imshow
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", lambda self, *a, **k: seen.append(k["vmax"]) or real(self, *a, **k))
    grids = {"full precision": [[0.35, 0.2]], "wush": [[0.1, math.nan]]}
    out = plot_heatmaps(grids, [0.5], [1024, 2048], tmp_path / "p.png", "context", "depth", "t", vmax=None)
    plot_heatmaps(grids, [0.5], [1024, 2048], tmp_path / "q.png", "context", "depth", "t")
    assert seen == [0.35, 0.35, 1.0, 1.0]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_plots_show_values_below_the_reference(tmp_path, monkeypatch):
    """A method below full precision (negative Δ%, as held-out text gives a 3-4-bit cache) is drawn where it is, on a
    symmetric log axis, not clamped onto a floor with the others; all-positive series keep the log axis."""
    import matplotlib.axes

    from wushkv.report import plot_lines

    scales, drawn = [], []
    real_scale, real_plot = matplotlib.axes.Axes.set_yscale, matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "set_yscale", lambda self, v, **k: scales.append(v) or real_scale(self, v, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **k: drawn.append(list(y)) or real_plot(self, x, y, *a, **k))
    out = plot_lines([2, 3, 4], {"wush": [7.9, 0.87, 0.15], "auto": [-0.81, -0.07, math.nan]}, tmp_path / "s.png", "bits", "%", "t",
                     logy=True)
    plot_lines([2, 3, 4], {"wush": [7.9, 0.87, 0.15]}, tmp_path / "l.png", "bits", "%", "t", logy=True)
    assert scales == ["symlog", "log"] and drawn[1][:2] == [-0.81, -0.07]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bar_plot_draws_each_value_in_order_and_logs_only_positive_ones(tmp_path, monkeypatch):
    """One bar per name, top to bottom in the given order at its own length (NaN: an empty slot), the highlighted one
    in another colour; a log axis only where every value is positive."""
    import matplotlib.axes

    from wushkv.report import plot_bars

    bars, scales = [], []
    real_barh, real_scale = matplotlib.axes.Axes.barh, matplotlib.axes.Axes.set_xscale
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda self, y, w, **k: bars.append((list(y), list(w), k["color"]))
                        or real_barh(self, y, w, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xscale", lambda self, v, **k: scales.append(v) or real_scale(self, v, **k))
    out = plot_bars({"wush": 36.4, "wush+cover4096": 3.7, "skipped": math.nan}, tmp_path / "b.png", "%", "t",
                    highlight={"wush+cover4096"}, logx=True)
    plot_bars({"a": 1.0, "b": -0.5}, tmp_path / "c.png", "%", "t", logx=True)
    (y, w, c), (_, w2, _) = bars
    assert y == [2, 1, 0] and w == [36.4, 3.7, 0.0] and c == ["tab:blue", "tab:orange", "tab:blue"] and w2 == [1.0, -0.5]
    assert scales == ["log"] and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
