"""``python -m ray_jobs.generate``: sampling against a loop written here by hand, seeds that repeat,
greedy decoding, and every bad input one ``error:`` line."""

from __future__ import annotations

import io
import json

import pytest
import torch

from models import build_model
from ray_jobs.data.tokenizer import EOT_TEXT, ByteTokenizer, train_bpe
from ray_jobs.generate import main
from ray_jobs.predict.generate import LanguageModel, Sampling, sample
from tests.helpers import fresh_output

GPT = {"name": "gpt", "in_features": 257, "out_features": 257, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """main() sets torch's threads for its process (--threads); the test session keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def lm_run(run_dir, record=GPT, task="lm", tokenizer=None, block_size=6, seed=0) -> torch.nn.Module:
    """A finished lm run's directory as the trainer leaves it (summary.json, model.pt, tokenizer.json),
    without training. Returns the model."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build_model(**record)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    (run_dir / "model.pt").write_bytes(buffer.getvalue())
    summary = {"model": record, "task": task, "config": {}, "block_size": block_size}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "tokenizer.json").write_text((tokenizer or ByteTokenizer()).to_json())
    return model.eval()


def reference_sample(model, ids, steps, temperature, top_k, seed, block_size) -> list[int]:
    """The sampling loop by hand, over plain tensors."""
    generator = torch.Generator().manual_seed(seed)
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens[-block_size:]]))[0, -1].float()
            if temperature == 0:
                tokens.append(int(logits.argmax()))
                continue
            logits = logits / temperature
            if top_k:
                kth = logits.sort(descending=True).values[top_k - 1]
                logits[logits < kth] = float("-inf")
            tokens.append(int(torch.multinomial(logits.softmax(-1)[None], 1, generator=generator)))
    return tokens[len(ids) :]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, None), (1.0, None), (0.7, 5)])
def test_sampling_matches_the_loop_by_hand(tmp_path, temperature, top_k):
    model = lm_run(tmp_path / "run")
    lm = LanguageModel(model, ByteTokenizer(), 6, 257, torch.device("cpu"))
    prompt = list(b"hello world")  # longer than the context of 6: cropped to the last 6
    got = sample(lm, prompt, Sampling(12, temperature, top_k, seed=3))
    assert got == reference_sample(model, prompt, 12, temperature, top_k, 3, 6)


def test_same_seed_same_text_and_greedy_ignores_the_seed(tmp_path, capsys):
    lm_run(tmp_path / "run")
    base = [str(tmp_path / "run"), "--prompt", "Once", "--max-new-tokens", "12", "--top-k", "50"]
    texts = {}
    for seed in ("1", "1", "2"):
        code, out, err = run(capsys, *base, "--temperature", "1.0", "--seed", seed)
        assert code == 0, err
        texts.setdefault(seed, []).append(out)
    assert texts["1"][0] == texts["1"][1] and texts["1"][0] != texts["2"][0]
    assert texts["1"][0].startswith("Once")
    greedy = {run(capsys, *base, "--temperature", "0", "--seed", seed)[1] for seed in ("1", "2")}
    assert len(greedy) == 1
    assert "12 tokens in" in run(capsys, *base)[2]


def test_a_bare_weights_file_takes_model_and_tokenizer_flags(tmp_path, capsys):
    model = lm_run(tmp_path / "run")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "weights.pt").write_bytes((tmp_path / "run" / "model.pt").read_bytes())
    options = ["--model-option", "n_layer=1", "--model-option", "n_head=2", "--model-option", "n_embd=16"]
    argv = [str(tmp_path / "bare" / "weights.pt"), "--prompt", "ab", "--temperature", "0", "--max-new-tokens", "5"]
    code, out, err = run(capsys, *argv, "--model", "gpt", *options, "--model-option", "block_size=8",
                         "--tokenizer", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, err
    expected = reference_sample(model, list(b"ab"), 5, 0.0, None, 0, 8)  # the model's block_size: 8
    assert out == "ab" + ByteTokenizer().decode(expected) + "\n"
    # beside a run's summary.json, a weights file is that run's model (best_model.pt, a copy)
    (tmp_path / "run" / "copy.pt").write_bytes((tmp_path / "run" / "model.pt").read_bytes())
    code, out, err = run(capsys, str(tmp_path / "run" / "copy.pt"), *argv[1:])
    assert code == 0, err
    assert out == "ab" + ByteTokenizer().decode(reference_sample(model, list(b"ab"), 5, 0.0, None, 0, 6)) + "\n"


def test_bpe_runs_decode_with_their_tokenizer_and_show_end_of_text(tmp_path, capsys):
    tokenizer = train_bpe(iter(["the cat sat on the mat\n" * 20, "a dog ran\n" * 20]), 300)
    record = {**GPT, "in_features": tokenizer.vocab_size, "out_features": tokenizer.vocab_size}
    model = lm_run(tmp_path / "run", record, tokenizer=tokenizer)
    code, out, err = run(capsys, str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "12",
                         "--temperature", "0.9", "--seed", "5")  # fmt: skip
    assert code == 0, err
    ids = tokenizer.encode("the cat")
    assert out == "the cat" + tokenizer.decode(reference_sample(model, ids, 12, 0.9, None, 5, 6)) + "\n"
    # an empty prompt starts a new document: the context is end-of-text
    lm = LanguageModel(model, tokenizer, 6, record["out_features"], torch.device("cpu"))
    assert sample(lm, [tokenizer.eot_id], Sampling(4, 0.0)) == reference_sample(model, [0], 4, 0.0, None, 0, 6)
    assert tokenizer.decode([tokenizer.eot_id]) == EOT_TEXT


def test_a_vocabulary_padded_past_the_tokenizer_never_draws_the_padding(tmp_path):
    model = lm_run(tmp_path / "run", {**GPT, "in_features": 300, "out_features": 300})
    with torch.no_grad():
        model.head.lm_head.weight[257:] = 0
        model.head.lm_head.weight[257:, 0] = 1e4  # the padding ids would win every draw
    lm = LanguageModel(model, ByteTokenizer(), 6, 300, torch.device("cpu"))
    assert max(sample(lm, [104, 105], Sampling(10, 1.0, seed=0))) < 257


def test_bad_input_is_one_error_line(tmp_path, capsys, monkeypatch):
    lm_run(tmp_path / "run")
    lm_run(tmp_path / "regression", task="regression")
    lm_run(tmp_path / "notok")
    (tmp_path / "notok" / "tokenizer.json").unlink()
    lm_run(tmp_path / "big", tokenizer=train_bpe(iter(["abc abd abe " * 30]), 400))  # a 257-token model
    (tmp_path / "empty").mkdir()
    lm_run(tmp_path / "user", {**GPT, "name": "tests.unit.test_generate:tiny_lm"})
    prompt = ["--prompt", "hi"]
    cases = [
        ([str(tmp_path / "nowhere")], "no such run directory or weights file"),
        ([str(tmp_path / "empty")], "has no summary.json: not a finished raypar run"),
        ([str(tmp_path / "regression")], "is not a language-model run (its task is regression)"),
        ([str(tmp_path / "notok")], "no tokenizer.json in"),
        ([str(tmp_path / "run"), "--tokenizer", str(tmp_path / "none.json")], "--tokenizer"),
        ([str(tmp_path / "run"), "--checkpoint", "best"], "has no best_model.pt (the run had no --val-data)"),
        ([str(tmp_path / "run"), "--temperature", "-1"], "--temperature must be at least 0, got -1.0"),
        ([str(tmp_path / "run"), "--top-k", "0"], "--top-k must be at least 1, got 0"),
        ([str(tmp_path / "run"), "--threads", "0"], "--threads must be at least 1, got 0"),
        ([str(tmp_path / "run"), "--block-size", "0"], "--block-size must be at least 1, got 0"),
        ([str(tmp_path / "run"), "--block-size", "9"], "--block-size 9 is longer than the model's block_size 8"),
        ([str(tmp_path / "run"), "--model-option", "n_layer=2"], "records its model's options already"),
        ([str(tmp_path / "run" / "model.pt"), "--checkpoint", "best"], "is a weights file already"),
        ([str(tmp_path / "big"), "--prompt", "abc abd abe"], "beyond the model's vocabulary of 257"),
        ([str(tmp_path / "user")], "was trained with your own model code tests.unit.test_generate:tiny_lm"),
    ]
    if not torch.cuda.is_available():
        cases.append(([str(tmp_path / "run"), "--device", "cuda"], "--device cuda: torch sees no CUDA device"))
    for argv, message in cases:
        code, out, err = run(capsys, *argv, *([] if "--prompt" in argv else prompt))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], (argv, err)
        assert out == ""
    # a bare weights file: its model must be named
    (tmp_path / "bare.pt").write_bytes((tmp_path / "run" / "model.pt").read_bytes())
    code, _, err = run(capsys, str(tmp_path / "bare.pt"), "--tokenizer", str(tmp_path / "run"))
    assert code == 2 and "name it with --model" in err
    code, _, err = run(capsys, str(tmp_path / "bare.pt"), "--tokenizer", str(tmp_path / "run"), "--model", "gpt")
    assert code == 2 and "does not fit the model" in err  # gpt's default widths are not these weights'
    code, _, err = run(capsys, str(tmp_path / "user"), "--model", "tests.unit.test_generate:tiny_lm", *prompt)
    assert code == 0, err


def test_generate_runs_without_importing_ray(tmp_path):
    """Ray's import (0.3 to 0.8 s here, issue #39) would be start-up time that sampling never uses."""
    lm_run(tmp_path / "run")
    code = (
        "import sys; from ray_jobs.generate import main; "
        f"code = main([{str(tmp_path / 'run')!r}, '--max-new-tokens', '2']); "
        "print(code, *(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    )
    output = fresh_output(code)
    assert output.splitlines()[-1].split() == ["0"], output


def tiny_lm(in_features: int, out_features: int, **options) -> torch.nn.Module:
    """A user's language model: gpt under another name."""
    return build_model("gpt", in_features, out_features, **options)
