import json

import pytest

from torchspeed.cli.main import main
from torchspeed.env import cpu_flags, detect


def test_detect_matches_cpu_flags():
    info = detect()
    flags = cpu_flags()
    assert info.avx512 == ("avx512f" in flags)
    assert info.avx512_bf16 == ("avx512_bf16" in flags)
    assert info.best_precision in ("fp32", "bf16", "fp16")
    if info.device == "cpu":
        assert info.best_precision == ("bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32")


def test_env_command_prints_json(capsys):
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"] and "best_precision" in data and "allocator" in data


def test_env_command_prints_table(capsys):
    assert main(["env"]) == 0
    assert "precision='auto' picks" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--batch-size", "0"], "--batch-size must be positive"),
    (["bench", "--steps", "-1"], "--steps must be positive"),
    (["bench", "--configs", "nope", "--model", "mlp"], "unknown bench config"),
])
def test_bench_bad_input_is_a_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_tcmalloc_is_found_by_file_name_on_ld_library_path_without_starting_a_process(tmp_path, monkeypatch):
    """find_tcmalloc reads folders (no ldconfig or gcc process: fit's first call pays for detect): a library on
    LD_LIBRARY_PATH is found, the minimal one first; an empty folder finds none of its own."""
    import subprocess

    from torchspeed import _allocator

    (tmp_path / "libtcmalloc.so.4").touch()
    (tmp_path / "libtcmalloc_minimal.so.4").touch()
    monkeypatch.setattr(_allocator, "TCMALLOC_DIRS", ())
    monkeypatch.setattr(_allocator.sys, "prefix", str(tmp_path / "none"))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))

    def no_process(*a, **k):
        raise AssertionError("find_tcmalloc started a process")
    monkeypatch.setattr(subprocess, "Popen", no_process)
    assert _allocator.find_tcmalloc() == str(tmp_path / "libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "empty"))
    assert _allocator.find_tcmalloc() is None
