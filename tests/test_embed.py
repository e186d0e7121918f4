"""The packaged all-MiniLM-L6-v2 model, loaded offline."""

import numpy as np
import pytest

from consolidate.embed import Embedder, packaged_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def emb():
    return Embedder(device="cpu", show_progress=False)


def test_model_ships_in_the_package():
    assert (packaged_model_path() / "model.safetensors").exists()


def test_encode_is_normalised_and_negation_scores_high(emb):
    v = emb.encode(["I live in Berlin", "I don't live in Berlin", "lunch was soup"])
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    s = v @ v.T
    # why the conflict guard exists: a negation scores above many paraphrases
    assert 0.8 < s[0, 1] < 0.95 and s[0, 2] < 0.3
    assert emb.encode([]).shape == (0, 384)


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="not found"):
        Embedder("/nonexistent/model")


def test_packed_pipeline_equals_plain_encode(emb):
    assert emb.pipeline == "packed"
    plain = Embedder(device="cpu", show_progress=False, pipeline="st", long_text="truncate")
    g = np.random.default_rng(0)
    words = ["Gina", "adopted", "two", "cats", "in", "May", "and", "Jon", "dances", "daily"]
    # lengths from one word to past the 256-token limit (truncated), shuffled
    texts = [" ".join(g.choice(words, n)) for n in g.integers(1, 300, 60)] + ["x"]
    g.shuffle(texts)
    a = plain.encode(texts)
    packed = Embedder(device="cpu", show_progress=False, batch_tokens=512, long_text="truncate")
    b = packed.encode(texts)
    assert b.shape == a.shape == (61, 384) and b.dtype == np.float32
    np.testing.assert_allclose(b, a, atol=2e-5)  # same order, same vectors
    # every word is one token here: texts of more than 254 words are cut (CLS and SEP)
    assert packed.truncated == plain.truncated == sum(len(t.split()) > 254 for t in texts) > 0


def test_inputs_the_model_cannot_embed_are_refused_by_position(emb):
    from consolidate.embed import EmbedInputError

    with pytest.raises(ValueError, match=r"texts\[1\] is empty or whitespace only") as e:
        emb.encode(["fine", " \t\n"])
    assert isinstance(e.value, EmbedInputError) and e.value.index == 1
    with pytest.raises(TypeError, match=r"texts\[2\] is NoneType, not str"):
        emb.encode(["a", "b", None])
    with pytest.raises(
        ValueError,
        match=r"texts\[0\] has 402 tokens, the model reads at "
        r"most 256 .* embedder.long_text=truncate",
    ):
        emb.encode(["word " * 400, "fine"])
    with pytest.raises(ValueError, match="long_text"):
        Embedder(device="cpu", show_progress=False, long_text="drop")


def test_unknown_pipeline():
    with pytest.raises(ValueError, match="pipeline"):
        Embedder(device="cpu", show_progress=False, pipeline="fast")
