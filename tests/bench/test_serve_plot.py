"""TTFT against step, drawn from a serve report's dict: one line and band per configuration."""

from __future__ import annotations

import pytest

from kvtier.bench.serve_plot import plot_ttft_by_step, ttft_by_step


def turns(ttfts_by_step: list[list[float]]) -> list[dict[str, object]]:
    return [{"conversation": c, "turn": step, "ttft_s": ttft}
            for step, ttfts in enumerate(ttfts_by_step) for c, ttft in enumerate(ttfts)]


def report() -> dict[str, object]:
    """vllm and kvtier, two runs each, three steps; a third configuration ran nothing."""
    results = [{"name": name, "repeat": repeat, "turns": turns(steps)} for repeat in (0, 1) for name, steps in (
        ("vllm", [[0.20, 0.22], [0.30, 0.34], [0.40, 0.44]]),
        ("kvtier", [[0.21, 0.23], [0.05, 0.06], [0.06, 0.07]]),
    )]
    return {"config": {}, "workload": {}, "results": results + [{"name": "idle", "repeat": 0, "turns": []}]}


def test_every_configurations_records_gather_by_step_over_its_runs_in_ms():
    data = ttft_by_step(report())
    assert list(data) == ["vllm", "kvtier", "idle"] and data["idle"] == {}
    assert data["kvtier"][1] == pytest.approx([50.0, 60.0, 50.0, 60.0])
    assert sorted(data["vllm"]) == [0, 1, 2]


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_the_figure_is_written_in_the_format_its_suffix_names(tmp_path, suffix):
    out = plot_ttft_by_step(report(), tmp_path / f"ttft{suffix}", title="two configurations")
    data = out.read_bytes()
    assert out == tmp_path / f"ttft{suffix}" and len(data) > 1000
    if suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    elif suffix == ".pdf":
        assert data.startswith(b"%PDF")
    else:
        text = data.decode()
        assert "<svg" in text and ">vllm<" in text and ">kvtier<" in text
        assert "step (turn)" in text and "TTFT ms" in text and "two configurations" in text


def test_a_trace_report_with_only_first_steps_still_plots(tmp_path):
    one_step = {"results": [{"name": "vllm", "repeat": 0, "turns": turns([[0.1, 0.2, 0.3]])}]}
    assert plot_ttft_by_step(one_step, tmp_path / "t.svg").exists()


def test_a_bad_suffix_or_an_empty_report_raises_before_writing(tmp_path):
    with pytest.raises(ValueError, match="'.jpg' is not one of .png, .svg, .pdf"):
        plot_ttft_by_step(report(), tmp_path / "ttft.jpg")
    with pytest.raises(ValueError, match="'\\(none\\)'"):
        plot_ttft_by_step(report(), tmp_path / "ttft")
    with pytest.raises(ValueError, match="no TTFT to plot"):
        plot_ttft_by_step({"results": [{"name": "vllm", "repeat": 0, "turns": []}]}, tmp_path / "t.png")
    with pytest.raises(ValueError, match="no 'results'"):
        plot_ttft_by_step({}, tmp_path / "t.png")
    assert not list(tmp_path.iterdir())


def test_plotting_leaves_matplotlibs_global_settings_alone(tmp_path):
    import matplotlib

    before = dict(matplotlib.rcParams)
    plot_ttft_by_step(report(), tmp_path / "ttft.svg")
    assert dict(matplotlib.rcParams) == before
