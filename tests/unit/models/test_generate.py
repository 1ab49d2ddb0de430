"""Generation: greedy decoding with the KV cache equals re-running the whole sequence."""
import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.models.generate import check_sampling, generate
from lmforge.models.llama import build_llama, materialize

ARGS = tiny_llama_args(vocab_size=53)


def _model():
    torch.manual_seed(3)
    return materialize(build_llama(ARGS), "cpu").eval()


def test_greedy_with_cache_equals_recomputing_everything():
    model = _model()
    prompt = [1, 5, 9, 2]
    cached = generate(model, prompt, 12, greedy=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert cached == ids[len(prompt):]


def test_sampling_is_reproducible_from_a_seed_and_stops_on_a_stop_id():
    model = _model()
    a = generate(model, [1, 2], 10, greedy=False, top_k=5, top_p=0.9,
                 generator=torch.Generator().manual_seed(0))
    b = generate(model, [1, 2], 10, greedy=False, top_k=5, top_p=0.9,
                 generator=torch.Generator().manual_seed(0))
    assert a == b and len(a) == 10
    stop = a[3]
    c = generate(model, [1, 2], 10, greedy=False, top_k=5, top_p=0.9, stop_ids=(stop,),
                 generator=torch.Generator().manual_seed(0))
    assert c[-1] == stop and len(c) == a.index(stop) + 1


def test_generation_never_runs_past_max_seq_len():
    model = _model()
    out = generate(model, [i % 50 for i in range(60)], 50, greedy=True)
    assert len(out) == ARGS.max_seq_len - 60


@pytest.mark.parametrize("setting,message", [
    (dict(temperature=float("nan")), r"^temperature: nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), r"^temperature: inf must be"),
    (dict(temperature=-0.1), r"^temperature: -0\.1 must be"),
    (dict(top_k=-1), r"^top_k: -1 must be >= 0"),
    (dict(top_p=0.0), r"^top_p: 0\.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"^top_p: 1\.5 must be in"),
    (dict(top_p=float("nan")), r"^top_p: nan must be in"),
])
def test_settings_that_cannot_sample_are_refused_before_any_token(setting, message):
    model = _model()
    with pytest.raises(ValueError, match=message):
        generate(model, [1, 2], 4, greedy=False, **setting)


def test_check_sampling_names_the_options_of_its_caller():
    names = {"max_new_tokens": "--max-new-tokens", "top_p": "--top-p"}
    with pytest.raises(ValueError, match=r"^--max-new-tokens: 0 must be > 0$"):
        check_sampling(0, 1.0, None, None, names)
    with pytest.raises(ValueError, match=r"^--top-p: 2 must be in \(0, 1\]$"):
        check_sampling(8, 1.0, None, 2, names)
