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
