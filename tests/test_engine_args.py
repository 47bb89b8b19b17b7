"""EngineArgs: one definition of every engine option, reachable from LLM(...) and every
command, validated before anything loads, with errors that name the option as it was given."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from octavo import engine_args
from octavo.cli import build_parser
from octavo.engine_args import OPTION_NAMES, EngineArgs, EngineArgsError, from_kwargs


def subparser(name: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]


def dests(parser) -> set[str]:
    return {a.dest for a in parser._actions}


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "demo"])
def test_every_option_is_a_flag_of_every_engine_command(command):
    assert set(OPTION_NAMES) <= dests(subparser(command))


def test_bench_takes_every_option_it_does_not_set_itself():
    from octavo.bench.cli import BENCH_OWNED

    bench = subparser("bench")
    assert set(OPTION_NAMES) - set(BENCH_OWNED) <= dests(bench)
    args = bench.parse_args(["throughput", "--attention-backend", "torch", "--block-size", "32",
                             "--no-enable-prefix-caching"])
    assert engine_args.cli_overrides(args, BENCH_OWNED) == {
        "attention_backend": "torch", "block_size": 32, "enable_prefix_caching": False}


def test_defaults_live_in_one_place():
    args = subparser("serve").parse_args([])
    assert engine_args.from_cli_args(args) == EngineArgs()
    assert EngineArgs().as_dict() == {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def test_flags_round_trip_through_their_command_line_spelling():
    changed = dict(block_size=32, enable_prefix_caching=False, max_model_len=300,
                   gpu_memory_utilization=0.5, preemption_mode="swap", swap_space=0.25)
    flags = engine_args.to_cli_flags(changed)
    assert engine_args.from_cli_args(subparser("serve").parse_args(flags)) == (
        EngineArgs(**changed))


def test_every_field_is_documented():
    for f in dataclasses.fields(EngineArgs):
        assert len(f.metadata["help"]) > 10, f.name


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(block_size=7), "block_size: 7 is not one of 1, 8, 16, 32, 64, 128, 256"),
    (dict(dtype="int3"), "dtype: 'int3' is not one of auto, float32, bfloat16, float16"),
    (dict(max_num_seqs=0), "max_num_seqs: must be >= 1, got 0"),
    (dict(max_num_batched_tokens="2048"), "max_num_batched_tokens: must be an int"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization: must be in (0, 1]"),
    (dict(device="tpu"), "device: must be 'cpu', 'cuda' or 'cuda:N'"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching: must be a bool"),
    (dict(swap_space=-1.0), "swap_space: must be >= 0"),
    (dict(num_kv_blocks=0), "num_kv_blocks: must be >= 1"),
])
def test_bad_values_name_the_option(kwargs, message):
    with pytest.raises(EngineArgsError) as e:
        EngineArgs(**kwargs)
    assert message in str(e.value)


def test_a_misspelt_option_suggests_the_right_one():
    with pytest.raises(TypeError, match="unknown engine option 'blok_size'; did you mean "
                                        "'block_size'"):
        from_kwargs(blok_size=16)


def test_llm_rejects_bad_options_before_loading_anything(monkeypatch):
    from octavo import LLM
    from octavo.engine import engine

    monkeypatch.setattr(engine, "resolve_model_dir", lambda m: pytest.fail("loaded a model"))
    with pytest.raises(EngineArgsError, match="block_size"):
        LLM(block_size=7)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_the_cli_names_the_flag():
    with pytest.raises(EngineArgsError, match="^--max-num-seqs: must be >= 1, got 0$"):
        engine_args.from_cli_args(subparser("serve").parse_args(["--max-num-seqs", "0"]))


def test_octavo_serve_with_a_bad_block_size_fails_at_once_without_torch():
    """The flag is checked while parsing: no torch import, no weights, a message naming the
    flag and its allowed values, exit status 2."""
    probe = ("import sys\nfrom octavo.cli import main\n"
             "try:\n    main(['serve', '--block-size', '7'])\n"
             "except SystemExit as e:\n    code = e.code\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(code)\n")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    assert done.returncode == 2, done.stderr
    assert "argument --block-size: invalid choice: 7" in done.stderr
    assert "1, 8, 16, 32, 64, 128, 256" in done.stderr
    print(f"octavo serve --block-size 7 failed in {elapsed:.2f} s")  # for the record, not asserted
