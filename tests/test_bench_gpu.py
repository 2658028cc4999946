"""`kvring bench gpu` (``python -m kvring.bench.gpu``): its settings and flags everywhere, a
one-line error where there is no CUDA device, and (where there is one) a short run that writes
its JSON and plot.  Timings are not asserted: the bench measures, the tests check behaviour."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from kvring.bench.gpu import CASES, LAYOUTS, GpuSettings, main, parse_args, run_bench_gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_stand_in_client_takes_every_argument_the_worker_passes_the_real_one():
    """``HostParts`` stands in for ``ClusterClient.iter_layers`` in the worker's loads: a parameter
    the real one gained and the stand-in lacks fails every load of the bench (on a GPU only)."""
    import inspect

    from kvring.bench.gpu import HostParts
    from kvring.cachenode.client import ClusterClient

    real = set(inspect.signature(ClusterClient.iter_layers).parameters)
    assert real <= set(inspect.signature(HostParts.iter_layers).parameters)


def test_the_default_step_is_a_llama_8b_cache_in_flashattention_layout():
    settings, args = parse_args(["--json-out", "r.json", "--plot", "r.png"])
    assert settings == GpuSettings()
    assert (settings.layers, settings.kv_heads, settings.head_size, settings.block_size) == (32, 8, 128, 16)
    assert settings.layout == "LBNHC" and settings.channels == 256
    assert settings.step_bytes == 512 << 20  # 4,096 tokens x 128 KiB
    assert (str(args.json_out), str(args.plot)) == ("r.json", "r.png")


def test_flags_override_the_defaults_and_the_quick_run():
    settings, _ = parse_args(["--chunks", "4", "--tokens", "1024", "--layout", "BLHNC", "--repetitions", "3"])
    assert (settings.chunks, settings.tokens, settings.layout, settings.repetitions) == (4, 1024, "BLHNC", 3)
    quick, _ = parse_args(["--quick", "--layout", "LBHNC"])
    assert quick == GpuSettings(**{**GpuSettings.quick().__dict__, "layout": "LBHNC"})
    assert set(LAYOUTS) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}


@pytest.mark.parametrize("argv, message", [
    (["--chunks", "0"], "chunks must be at least 1, got 0"),
    (["--layout", "NHD"], "invalid choice: 'NHD'"),
    (["--tokens", "many"], "invalid int value: 'many'"),
])
def test_bad_flags_exit_2_naming_the_problem(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_settings_that_cannot_be_a_model_are_refused():
    with pytest.raises(ValueError, match="30 query heads cannot share 8 KV heads evenly"):
        GpuSettings(q_heads=30)
    with pytest.raises(ValueError, match="layout 'NHD' is not one of vLLM's"):
        GpuSettings(layout="NHD")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path, capsys):
    out, plot = tmp_path / "gpu.json", tmp_path / "gpu.png"
    assert main(["--json-out", str(out), "--plot", str(plot)]) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"error: kvring bench gpu needs a CUDA device; torch {torch.__version__} sees none here "
                            "(torch.cuda.is_available() is False)\n")
    assert captured.out == ""
    assert not out.exists() and not plot.exists()


@needs_cuda
def test_cuda_quick_run_writes_every_case_to_json_and_a_plot(tmp_path):
    out, plot = tmp_path / "gpu.json", tmp_path / "gpu.png"
    settings = GpuSettings.quick()
    results = run_bench_gpu(settings, out, plot, console=Console(file=io.StringIO()))
    written = json.loads(out.read_text())
    assert written["ratios"] == results["ratios"]
    assert list(written["seconds"]) == list(CASES)
    assert all(len(ts) == settings.repetitions and min(ts) > 0 for ts in written["seconds"].values())
    assert written["step_bytes"] == settings.step_bytes
    assert written["worker_load"]["parts"] == settings.chunks * settings.kv_heads
    assert plot.stat().st_size > 10_000
