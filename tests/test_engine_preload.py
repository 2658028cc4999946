"""vLLM's CPU engines run with the preloads its CPU guide sets up (kvring.engine.preload)."""

from __future__ import annotations

from pathlib import Path

from kvring.engine.preload import engine_env


def test_the_engines_environment_preloads_tcmalloc_and_libiomp_which_the_setup_installed():
    preload = engine_env({})["LD_PRELOAD"].split(":")
    names = [Path(p).name for p in preload]
    assert names[0].startswith("libtcmalloc") and names[1] == "libiomp5.so", preload
    assert all(Path(p).is_file() for p in preload)


def test_a_preload_already_set_is_kept_and_none_is_added_twice():
    first = engine_env({})["LD_PRELOAD"]
    again = engine_env({"LD_PRELOAD": f"/opt/other.so:{first.split(':')[0]}"})["LD_PRELOAD"].split(":")
    assert "/opt/other.so" in again and len(again) == len(set(again)) == 3


def test_gnu_openmp_inherited_from_a_process_that_imported_vllm_is_dropped():
    """vLLM refuses to start with both OpenMP runtimes preloaded; importing vLLM puts torch's
    libgomp into LD_PRELOAD (and so into every child's environment)."""
    inherited = "/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1"
    preload = engine_env({"LD_PRELOAD": f"{inherited}:/opt/other.so"})["LD_PRELOAD"].split(":")
    assert inherited not in preload and "/opt/other.so" in preload
    assert [Path(p).name for p in preload][:2] == [Path(p).name for p in engine_env({})["LD_PRELOAD"].split(":")]
