"""The command line: generate prints completions, chat streams and keeps the conversation."""

from __future__ import annotations

from octavo.cli import build_parser, cmd_chat, main


def test_generate_prints_completions(tiny_llama_dir, capsys):
    rc = main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "5",
               "--num-kv-blocks", "64", "--max-model-len", "256", "hello", "world"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "'hello' ->" in out and "'world' ->" in out


def test_generate_bad_model_is_a_clear_error(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing"), "x"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_chat_streams_keeps_history_and_resets(tiny_llama_dir, capsys, monkeypatch):
    args = build_parser().parse_args(
        ["chat", "--model", str(tiny_llama_dir), "--max-tokens", "4", "--num-kv-blocks", "64",
         "--max-model-len", "512"])
    lines = iter(["first", "second", "/reset", "third", "/quit"])
    seen_prompts: list[int] = []
    from octavo.llm import LLM

    real = LLM.apply_chat_template

    def spy(self, conversation, *a, **k):
        seen_prompts.append(len(conversation))
        return real(self, conversation, *a, **k)

    monkeypatch.setattr(LLM, "apply_chat_template", spy)
    assert cmd_chat(args, read=lambda _: next(lines)) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 3
    # user, user+assistant+user, then after /reset only the new user message
    assert seen_prompts == [1, 3, 1]
