"""`arborspec chat` (chat.py): each answer is the one `generate` gives for the templated conversation, a later turn
starts from the kept cache, /reset and a stopped answer leave the conversation as a user expects, and the terminal
loop answers, resets and exits."""
from __future__ import annotations

import copy
import io

import pytest

from arborspec.chat import Conversation
from arborspec.cli import main
from arborspec.engine import SpeculativeDecoder
from arborspec.loading import load_model
from tests.backends.tiny_gguf import native_models
from tests.conftest import char_tokenizer, noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/conftest.py

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
FILES = {"target": {"dtype": "q4_k", "hidden": 256, "ffn": 512},
         "draft": {"dtype": "q4_k", "hidden": 256, "ffn": 512, "noise": 0.2}}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return native_models(tmp_path_factory.mktemp("chat"), FILES)


def decoder(native, template: str | None = TEMPLATE) -> SpeculativeDecoder:
    """The tiny native pair (its kept caches are exact: engine/prefix_cache.py), with a chat template."""
    tokenizer = copy.deepcopy(native("target").tokenizer)
    tokenizer.chat_template = template
    return SpeculativeDecoder(native("target").model, native("draft").model, tokenizer=tokenizer, method="static",
                              depth=3, branch=2)


def test_each_answer_is_generates_and_a_later_turn_starts_from_the_kept_cache(native):
    chat, fresh = Conversation(decoder(native), system="be brief", max_new_tokens=12), decoder(native)
    answers = []
    for turn, text in enumerate(["def fib(n):", "and for n = 10?"]):
        prompt = chat.prompt(text)
        streamed = "".join(chat.answer(text))
        alone = fresh.generate(prompt, max_new_tokens=12)
        assert streamed == chat.last.text == alone.text and chat.last.token_ids == alone.token_ids
        assert (chat.last.stats.cached_tokens > 0) == (turn > 0)  # the first turn's answer was kept
        answers.append(streamed)
    assert chat.messages == [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "def fib(n):"}, {"role": "assistant", "content": answers[0]},
                             {"role": "user", "content": "and for n = 10?"},
                             {"role": "assistant", "content": answers[1]}]
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "be brief"}]


def test_a_stopped_answer_joins_with_what_was_shown_and_one_past_the_context_window_not_at_all(native):
    chat = Conversation(decoder(native), max_new_tokens=24)
    answer = chat.answer("def fib(n):")
    shown = next(answer)
    answer.close()  # what Ctrl-C does to the loop
    assert chat.messages == [{"role": "user", "content": "def fib(n):"}, {"role": "assistant", "content": shown}]
    prompt, answer = chat.prompt("go on"), "".join(chat.answer("go on"))  # from the stopped answer's kept cache
    assert chat.last.stats.cached_tokens > 0 and answer == decoder(native).generate(prompt, max_new_tokens=24).text
    with pytest.raises(ValueError, match="context window"):
        list(chat.answer("x" * 400))  # the tiny target reads 256 tokens
    assert len(chat.messages) == 4


def test_a_target_without_a_chat_template_is_refused(native):
    with pytest.raises(ValueError, match="no chat template"):
        Conversation(decoder(native, template=None))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-dirs")
    target, tok = tiny_model("llama", seed=0), char_tokenizer()
    paths = {}
    for name, model, template in (("target", target, TEMPLATE), ("draft", noisy_copy(target, 0.2), TEMPLATE),
                                  ("plain", target, None)):
        tok.chat_template = template
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def chat_cli(model_dirs, capsys, monkeypatch, lines: str, target: str = "target") -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["chat", "--target", model_dirs[target], "--draft", model_dirs["draft"], "--dtype", "fp32",
                 "--method", "static", "--max-new-tokens", "8"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_terminal_loop_answers_resets_and_exits(model_dirs, capsys, monkeypatch):
    code, out, err = chat_cli(model_dirs, capsys, monkeypatch, "hello\n\n/reset\nhello\n/exit\nnot read\n")
    target = load_model(model_dirs["target"], dtype="fp32", progress=False)
    want = SpeculativeDecoder(target, method="ar").generate("user: hello\nassistant: ", max_new_tokens=8).text
    assert code == 0
    assert out == f"{want}\n{want}\n"  # the same answer after /reset; piped in, no "> " prompts among the answers
    assert err.count(" kept from the last turn") == 2 and "[a new conversation]" in err
    code, out, _ = chat_cli(model_dirs, capsys, monkeypatch, "hello\n")  # the input ends: so does the chat
    assert code == 0 and out == f"{want}\n"
    code, out, err = chat_cli(model_dirs, capsys, monkeypatch, "caf\udce9\nhello\n")  # a line that is not UTF-8
    assert code == 0 and out == f"{want}\n" and "[the message is not UTF-8 text" in err  # said; the chat goes on
    replies = iter(["hello"])  # then Ctrl-C at the prompt: interrupted, 130 as every other command (it was 0)

    def typed(prompt=""):
        try:
            return next(replies)
        except StopIteration:
            raise KeyboardInterrupt from None
    monkeypatch.setattr("builtins.input", typed)
    code, out, _ = chat_cli(model_dirs, capsys, monkeypatch, "")
    assert code == 130 and out == f"{want}\n"


def test_the_chat_command_refuses_a_target_without_a_chat_template(model_dirs, capsys, monkeypatch):
    code, _, err = chat_cli(model_dirs, capsys, monkeypatch, "hello\n", target="plain")
    assert code == 2 and "no chat template" in err and "Traceback" not in err


def test_a_message_of_several_lines_goes_between_triple_quotes(model_dirs, capsys, monkeypatch):
    code, out, _ = chat_cli(model_dirs, capsys, monkeypatch, '"""def f(x):\n    return x\n"""\n')
    target = load_model(model_dirs["target"], dtype="fp32", progress=False)
    want = SpeculativeDecoder(target, method="ar").generate("user: def f(x):\n    return x\nassistant: ",
                                                            max_new_tokens=8).text
    assert code == 0 and out == f"{want}\n"
    code, again, err = chat_cli(model_dirs, capsys, monkeypatch, '/rest\n"""def f(x):\n    return x\n')
    assert code == 0 and again == f"{want}\n"  # the input ended inside the quotes: still sent
    assert "[unknown command /rest" in err  # a mistyped command is not sent


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_an_answer_after_its_step_and_twice_at_once(native, presses, capsys):
    """A first Ctrl-C (SIGINT) stops the answer once the step in progress is shown; a second interrupts at once.
    Either way the shown text joins the conversation and Python's own handler is back afterwards."""
    import os
    import signal

    from arborspec.chat import stream

    chat = Conversation(decoder(native), max_new_tokens=24)
    whole = decoder(native).generate(chat.prompt("def fib(n):"), max_new_tokens=24).text

    def pressing(answer):  # Ctrl-C once the first chunk is out
        yield next(answer)
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)
        yield from answer

    assert stream(pressing(chat.answer("def fib(n):"))) is True
    shown = capsys.readouterr().out
    assert chat.messages[-1] == {"role": "assistant", "content": shown} and shown != whole and whole.startswith(shown)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_pasted_function_with_a_docstring_is_one_message(monkeypatch):
    """After a bare opening quote only a bare closing one ends the message: a docstring's last line ended it, and
    the rest of the function went as further messages."""
    from arborspec.chat import read_message
    lines = iter(['"""', "def area(r):", '    """Return the area of a circle."""', "    return 3.14159 * r * r",
                  '"""', '"""one line"""', '"""first', 'last"""'])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert read_message() == 'def area(r):\n    """Return the area of a circle."""\n    return 3.14159 * r * r'
    assert read_message() == "one line"
    assert read_message() == "first\nlast"


def test_a_system_message_that_cannot_run_and_a_bad_seed_are_refused_at_the_start(model_dirs, capsys, monkeypatch):
    """Both started a chat whose every turn failed, each telling the user to /reset (which kept them)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    base = ["chat", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--dtype", "fp32", "--method",
            "static", "--max-new-tokens", "8"]
    assert main(base + ["--seed", str(2 ** 64)]) == 2
    assert "seed must be an integer" in capsys.readouterr().err
    assert main(base + ["--system", "x" * 600]) == 2  # the tiny target reads 512 tokens
    err = capsys.readouterr().err
    assert "context window" in err and "/reset" not in err


def test_the_chat_keeps_the_last_turns_caches_only_and_none_after_a_reset(native, capsys):
    chat = Conversation(decoder(native), max_new_tokens=6)
    for text in ("def fib(n):", "and then?", "more"):
        "".join(chat.answer(text))
        entries = chat.decoder.prefix_cache._entries
        assert sorted(e.role for e in entries) == ["draft", "target"]  # the newest of each model
    chat.reset()
    assert chat.decoder.prefix_cache._entries == []


def test_one_token_answers_claim_no_speed(native):
    from arborspec.chat import describe
    chat = Conversation(decoder(native), max_new_tokens=1)
    "".join(chat.answer("def fib(n):"))
    line = describe(chat.last)
    assert line.startswith("[1 token, 1.00 tokens/step")  # it read "[1 tokens, 0.0 tokens/s"


def test_a_system_message_that_a_template_writes_into_the_first_turn_is_accepted():
    """Llama-2's template writes the system message into the first user turn, so alone it renders to nothing: the
    start-up check read that as an empty prompt."""
    tok = char_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}{% set sys = '<<'"
                         " + messages[0]['content'] + '>> ' %}{% else %}{% set rest = messages %}{% set sys = '' %}"
                         "{% endif %}{% for m in rest %}{% if loop.index0 == 0 %}[INST] {{ sys }}{{ m['content'] }}"
                         " [/INST]{% else %} {{ m['content'] }}{% endif %}{% endfor %}")
    chat = Conversation(SpeculativeDecoder(tiny_model("llama"), tokenizer=tok, method="ar"), system="be brief",
                        max_new_tokens=2)
    assert "".join(chat.answer("hi")) == chat.last.text
