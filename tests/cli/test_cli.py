"""`metasd generate` and `calibrate`: the JSON contract, prompt files, T(M), clear errors with a non-zero exit."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from metasd.cli import main


def run(capsys, *argv):
    code = main(["generate", "--drafters", "ngram,suffix", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_contract(capsys, embedded):
    code, out, _ = run(capsys, "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json")
    assert code == 0
    record = json.loads(out)
    assert set(record) >= {"text", "token_ids", "stats"}
    stats = record["stats"]
    for key in ("new_tokens", "rounds", "mean_accepted_tokens", "tokens_per_second", "switches", "catch_up_tokens"):
        assert key in stats
    assert stats["new_tokens"] == len(record["token_ids"]) <= 12
    assert set(stats["drafters"]) <= {"ngram", "suffix"}
    assert all(set(d) == {"pulls", "drafted", "accepted", "mean_reward"} for d in stats["drafters"].values())
    assert record["text"] == embedded.tokenizer.decode(record["token_ids"], skip_special_tokens=True)


def test_prompt_file_gives_one_result_per_line(capsys, tmp_path, embedded):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Say hi."}\n\n{"prompt": "Say bye."}\n')
    code, out, _ = run(capsys, "--prompt-file", str(path), "--max-new-tokens", "6", "--json", "--raw")
    assert code == 0
    assert len([json.loads(line) for line in out.splitlines()]) == 2


def test_a_prompt_file_can_teach_the_pools_head(capsys, tmp_path, embedded):
    """`--learn-heads`: the head collects what it verifies while the prompts decode; with fewer new tokens than
    `--learn-every` no round of learning runs, so nothing is written and the output is as without it."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Say hi."}\n{"prompt": "Say bye."}\n')
    args = ["--prompt-file", str(path), "--max-new-tokens", "6", "--json", "--drafters", "eagle,ngram"]
    code, plain, _ = run(capsys, *args)
    code_learning, learning, _ = run(capsys, *args, "--learn-heads", str(tmp_path / "heads"), "--learn-every", "9999")
    assert code == code_learning == 0
    texts = [[json.loads(line)["token_ids"] for line in out.splitlines()] for out in (plain, learning)]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    assert not (tmp_path / "heads").exists()


def test_plain_output_prints_text_and_statistics(capsys, embedded):
    code, out, err = run(capsys, "--prompt", "Say hi.", "--max-new-tokens", "6", "--policy", "none")
    assert code == 0 and out.strip()
    assert "tok/s" in err and "mean accepted tokens" in err


def test_calibrate_max_batch_prints_t_b_w_and_refresh_measures_it_again(capsys, embedded, tmp_path, monkeypatch):
    import metasd.costs.calibration as calibration
    from metasd.models.linear_kernels import install, installed, installed_beyond

    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    measured = []
    real = calibration.calibrate_batch
    monkeypatch.setattr(calibration, "calibrate_batch", lambda m, sizes, w: measured.append(sizes) or real(m, sizes, w))
    before, beyond = installed(embedded.model), installed_beyond(embedded.model)
    try:
        for argv in ([], [], ["--refresh"]):
            assert main(["calibrate", "--max-tokens", "2", "--max-batch", "2", *argv]) == 0
            lines = capsys.readouterr().out.splitlines()
            assert lines[-3].startswith("T(B, W) in ms; cache: ") and lines[-2].split() == ["B", "W=1", "W=2"]
            size, *times = lines[-1].split()
            assert size == "2" and len(times) == 2 and all(float(t) > 0 for t in times)
    finally:
        if before is not None:
            install(embedded.model, before, beyond)
    assert measured == [[2], [2]]  # the second run read the cache; --refresh measured again


def test_calibrate_says_when_the_table_it_prints_was_not_cached(capsys, embedded, tmp_path, monkeypatch):
    import metasd.costs.calibration as calibration
    from metasd.models.linear_kernels import install, installed, installed_beyond

    monkeypatch.setenv("METASD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "CONTENDED", 0.25)
    ticks = iter([(1000, 600, 100), (2000, 1500, 400)])  # others held 60 % of the CPUs while it measured
    monkeypatch.setattr(calibration, "cpu_ticks", lambda: next(ticks))
    before, beyond = installed(embedded.model), installed_beyond(embedded.model)
    try:
        with pytest.warns(UserWarning, match="is not cached"):
            assert main(["calibrate", "--max-tokens", "2"]) == 0
    finally:
        if before is not None:
            install(embedded.model, before, beyond)
    assert "(this table is not in it: see the warning above)" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--top-p", "1.01"], "top_p"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
        (["--prompt", "hi", "--drafters", "medusa"], "unknown drafter"),
        (["--prompt", "hi", "--policy", "thompson"], "unknown policy"),
        (["--prompt", "hi", "--target", "/no/such/model"], "not found"),
        (["--prompt", "hi", "--drafters", "lm:/no/such/model"], "not found"),
        (["--prompt-file", "/no/such/file.jsonl"], "cannot read"),
        *([(["--prompt", "hi", "--device", "cuda"], "no CUDA device")] if not torch.cuda.is_available() else []),
        ([], "--prompt"),
    ],
)
def test_bad_input_is_a_clear_error_and_nonzero_exit(capsys, embedded, argv, message):
    code = main(["generate", *argv])
    _, err = capsys.readouterr()
    assert code != 0
    assert message in err and "Traceback" not in err


def test_malformed_prompt_file(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\nnot json\n')
    assert main(["generate", "--prompt-file", str(path)]) != 0
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_calibrate_prints_the_table_and_the_kernel_of_each_m(capsys, embedded):
    from metasd.models.linear_kernels import KERNELS, install, installed, installed_beyond

    before, beyond = installed(embedded.model), installed_beyond(embedded.model)
    try:
        for mode, allowed in (("torch", {"linear"}), ("auto", set(KERNELS))):
            assert main(["calibrate", "--max-tokens", "3", "--kernels", mode]) == 0
            lines = capsys.readouterr().out.splitlines()
            rows = [line.split() for line in lines[2:5]]
            assert [int(r[0]) for r in rows] == [1, 2, 3]
            assert all(float(r[1]) > 0 for r in rows) and {r[3] for r in rows} <= allowed
            assert lines[5].startswith("more than 3 tokens") and lines[5].rsplit(" ", 1)[1] in allowed
    finally:
        if before is not None:
            install(embedded.model, before, beyond)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--max-batch", "0"], "--max-batch"),
        (["calibrate", "--max-batch", "0"], "--max-batch"),
        (["serve-bench", "--clients", "0"], "--clients"),
        (["serve-bench", "--max-batch", "0"], "--max-batch"),
        (["serve", "--learn-heads", "d", "--replicas", "2"], "--learn-heads"),
        (["serve", "--learn-heads", "d", "--learn-share", "0"], "--learn-share"),
        (["generate", "--prompt", "Hi", "--learn-heads", "d", "--learn-every", "0"], "--learn-every"),
    ],
)
def test_serving_options_are_checked_before_anything_loads(capsys, argv, message):
    code = main(argv)
    _, err = capsys.readouterr()
    assert code != 0 and message in err and "Traceback" not in err


def test_learning_options_make_the_learning_config():
    """`--learn-*` become the learner's configuration; `--learn-when-busy` lets it train beside decoding."""
    from metasd.cli.args import add_learning_args, learning_config

    parser = argparse.ArgumentParser()
    add_learning_args(parser)
    assert learning_config(parser.parse_args([])) is None
    config = learning_config(parser.parse_args(["--learn-heads", "d", "--learn-every", "64", "--learn-when-busy"]))
    assert config.when_busy and config.train_every == 64
    assert not learning_config(parser.parse_args(["--learn-heads", "d"])).when_busy


def test_parsing_any_command_line_loads_no_model_code():
    """`metasd --help`, every subcommand's help and an argument error answer without importing torch or
    transformers (seconds on a small CPU): each subcommand imports what it runs only when it runs. A fresh
    interpreter, since this one has loaded both."""
    script = """
import contextlib, io, sys
from metasd.cli import build_parser
parser = build_parser()
commands = next(a for a in parser._actions if a.dest == "command").choices
for argv in (["--help"], *[[c, "--help"] for c in commands], ["generate", "--max-new-tokens", "x"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit:
            pass
print(len(commands), sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["8", "[]"]
