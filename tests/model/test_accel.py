"""Fast tower inference (triclip.model.accel) against the eager fp32 reference, on the real lite weights.

Every fast path must give the eager outputs within cosine 0.999 per row; the
fallbacks must work when ONNX Runtime is not installed; the fast path must never
serve stale weights or run where autograd or training mode is needed.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from triclip.model import accel  # noqa: E402
from triclip.model.embed import embed_pil_images, embed_texts  # noqa: E402
from triclip.core.errors import UserError  # noqa: E402
from triclip.model.model import ModelConfig, build_model  # noqa: E402

MIN_COS = 0.999  # the contract: fast outputs within this cosine of eager fp32, per row
CAPTIONS = [
    "a cat",
    "red apple on a wooden table, drawn as clip art with thick outlines",
    "",
    "house, tree, garden, sun, cloud, road, car, bicycle, dog, fence, window, door, roof, chimney, smoke",
    "Ünïcödé 文字 and emoji 🙂",
]

needs_onnxruntime = pytest.mark.skipif(not accel.onnxruntime_available(), reason="onnx / onnxruntime not installed")


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(preset="lite", embed_dim=16)).eval()


@pytest.fixture(scope="module")
def images(model):
    """(4, 3, 224, 224): two drawn pictures and two noise images through the eval transform."""
    rng = np.random.default_rng(0)
    pictures = [Image.new("RGB", (300, 200), (250, 250, 250)), Image.new("L", (180, 240), 30)]
    pictures[0].paste((200, 30, 30), (40, 40, 160, 150))
    pictures[1].paste(220, (20, 100, 170, 130))
    pictures += [Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(2)]
    transform = model.image_transform(train=False)
    return torch.stack([transform(p) for p in pictures])


def _min_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float(), b.float(), dim=1).min().item()


@pytest.fixture(autouse=True)
def _forget_prepared():
    """Each test prepares its own fast modules (the cache is per tower, process-wide)."""
    accel._PREPARED.clear()
    accel._SHARED.clear()
    yield
    accel._PREPARED.clear()
    accel._SHARED.clear()


# ---------------------------------------------------------------------------- agreement with eager


@pytest.mark.parametrize("backend", ["jit", pytest.param("onnxruntime", marks=needs_onnxruntime)])
def test_image_fast_path_matches_eager(model, images, backend):
    with torch.no_grad():
        reference = model.image_tower(images)  # (4, 1280)
        fast = accel.inference_module(model.image_tower, backend)(images)
    assert accel.active_backend(model.image_tower) == backend
    assert fast.shape == reference.shape and fast.dtype == torch.float32
    assert _min_cos(fast, reference) >= MIN_COS
    assert not torch.equal(fast[0], fast[2])  # different images, different features


@needs_onnxruntime
def test_text_fast_path_matches_eager_with_padding(model):
    tokens = model.tokenize(CAPTIONS)  # padded to the longest caption
    with torch.no_grad():
        reference = model.text_tower(tokens)  # (5, 384)
        fast = accel.inference_module(model.text_tower, "onnxruntime")(tokens)
        single = accel.inference_module(model.text_tower, "onnxruntime")(model.tokenize(CAPTIONS[:1]))
    assert _min_cos(fast, reference) >= MIN_COS
    assert _min_cos(single, reference[:1]) >= MIN_COS  # other batch and length than the export's


def test_embed_functions_use_the_fast_path_and_keep_order(model):
    """embed_texts sorts by length internally: rows must still follow the input order."""
    with torch.no_grad():
        reference = model.encode_text(CAPTIONS)  # (5, 16) eager
    fast = embed_texts(model, CAPTIONS, "cpu", batch_size=2)
    assert _min_cos(fast, reference) >= MIN_COS
    expected = "onnxruntime" if accel.onnxruntime_available() else "eager"
    assert accel.active_backend(model.text_tower) == expected
    picture = Image.new("RGB", (120, 90), (10, 120, 200))
    with torch.no_grad():
        eager_image = model.encode_image(model.image_transform(train=False)(picture).unsqueeze(0))
    assert _min_cos(embed_pil_images(model, [picture], "cpu"), eager_image) >= MIN_COS
    assert accel.active_backend(model.image_tower) in ("onnxruntime", "jit")


# ---------------------------------------------------------------------------- when the fast path must not run


def test_autograd_and_training_mode_use_the_eager_module(model, images):
    x = images[:1]
    features = accel.image_features(model, x)  # grad enabled: eager
    assert features.grad_fn is not None
    assert accel.active_backend(model.image_tower) == "eager"  # nothing was prepared
    model.image_tower.train()
    try:
        with torch.no_grad():
            accel.image_features(model, x)
        assert accel.active_backend(model.image_tower) == "eager"
    finally:
        model.image_tower.eval()
    with torch.no_grad():
        accel.image_features(model, x[:, :, :200, :200])  # not the exported size: eager
    assert accel.active_backend(model.image_tower) == "eager"


@needs_onnxruntime
def test_changed_weights_are_never_served_stale(model):
    tower = model.text_tower
    tokens = model.tokenize(CAPTIONS[:2])
    word_embeddings = tower.bert.embeddings.word_embeddings.weight
    saved = word_embeddings.detach().clone()
    try:
        with torch.no_grad():
            before = accel.text_features(model, tokens)
            word_embeddings.mul_(-1.0)  # in place, as an optimizer step is
            after = accel.text_features(model, tokens)
            eager_after = model.text_tower(tokens)
        assert accel.active_backend(tower) == "onnxruntime"
        assert _min_cos(after, eager_after) >= MIN_COS
        assert _min_cos(after, before) < 0.99
    finally:
        with torch.no_grad():
            word_embeddings.copy_(saved)


@needs_onnxruntime
def test_image_outputs_do_not_depend_on_the_batch_size(model, images):
    """Why an embedding pass can use batches of accel.IMAGE_BATCH: each row is computed on its own."""
    run = accel.inference_module(model.image_tower, "onnxruntime")
    with torch.no_grad():
        whole = run(images)  # (4, 1280)
        halves = torch.cat([run(images[:2]), run(images[2:])])
        ones = torch.cat([run(images[i : i + 1]) for i in range(len(images))])
    assert torch.equal(whole, halves) and torch.equal(whole, ones)


@needs_onnxruntime
def test_an_image_session_is_called_with_at_most_session_images_rows(model, images, monkeypatch):
    """Why a pass's session memory stays that of a few images (accel.SESSION_IMAGES), whatever the batch."""
    import onnxruntime as ort

    rows = []

    class Counting(ort.InferenceSession):
        def run(self, output_names, feed, *args, **kwargs):
            rows.append(len(next(iter(feed.values()))))
            return super().run(output_names, feed, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Counting)
    monkeypatch.setattr(accel, "SESSION_IMAGES", 3)
    batch = torch.cat([images, images.flip(0), images[:2]])  # (10, 3, 224, 224)
    run = accel.inference_module(model.image_tower, "onnxruntime")
    with torch.no_grad():
        whole = run(batch)
        ones = torch.cat([run(batch[i : i + 1]) for i in range(len(batch))])
    assert rows[:4] == [3, 3, 3, 1] and max(rows) == 3
    assert whole.shape == (10, 1280) and torch.equal(whole, ones)


@needs_onnxruntime
def test_a_single_threaded_session_called_from_two_threads_gives_the_same_features_bit_for_bit(model, images):
    """Why an embedding pass may run two single-threaded calls at once (cache.image_tower_pass)."""
    with torch.no_grad():
        default = accel.image_features(model, images)  # torch's thread count
    results = {}

    def call(rows: slice):
        with torch.no_grad():  # grad mode is per thread
            results[rows.start] = accel.image_features(model, images[rows], single_thread=True)

    threads = [threading.Thread(target=call, args=(rows,)) for rows in (slice(0, 2), slice(2, 4))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(torch.cat([results[0], results[2]]), default)
    assert len(accel._PREPARED[model.image_tower]) == 2  # two sessions: torch's threads and one thread


def test_a_pass_runs_several_threads_only_where_onnxruntime_will_serve_a_tower(model, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert accel.pass_threads(model.image_tower, "cpu") == 1  # autograd on: the eager module, one caller
    with torch.no_grad():
        assert accel.pass_threads(model.image_tower, "cpu") == (2 if accel.onnxruntime_available() else 1)
        assert accel.pass_threads(model.text_tower, "cpu") == (2 if accel.onnxruntime_available() else 1)
        assert accel.pass_threads(model.image_head, "cpu") == 1  # not a tower: the module itself runs
        assert accel.pass_threads(model.image_tower, "cuda") == 1  # a GPU batch is one call
        monkeypatch.setenv(accel.ENV, "jit")
        assert accel.pass_threads(model.image_tower, "cpu") == 1  # torch's own threads: one caller
        monkeypatch.setenv(accel.ENV, "auto")
        monkeypatch.setitem(sys.modules, "onnxruntime", None)
        assert accel.pass_threads(model.image_tower, "cpu") == 1  # no session to call


@needs_onnxruntime
def test_a_tower_built_again_with_the_same_weights_reuses_the_session_and_a_changed_one_does_not(images, monkeypatch):
    exports = []
    original = accel._onnx_bytes
    monkeypatch.setattr(accel, "_onnx_bytes", lambda tower, size: exports.append(size) or original(tower, size))
    model = build_model(ModelConfig(preset="lite", embed_dim=16)).eval()  # not the fixture: a test ran it in train mode
    with torch.no_grad():
        first = accel.image_features(model, images)
        again = build_model(ModelConfig(preset="lite", embed_dim=16)).eval()  # a new module, the same weights
        assert again.image_tower is not model.image_tower
        reused = accel.image_features(again, images)
        assert exports == [224] and torch.equal(reused, first)
        again.image_tower.net.conv_stem.weight.mul_(0.5)  # in place: its own session from now on
        changed = accel.image_features(again, images)
        eager = again.image_tower(images)
    assert exports == [224, 224]
    assert _min_cos(changed, eager) >= MIN_COS and _min_cos(changed, first) < 0.999
    with torch.no_grad():
        assert torch.equal(accel.image_features(model, images), first)  # the first tower's own session is kept


# ---------------------------------------------------------------------------- fallbacks


def test_fallback_without_onnxruntime(model, images, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    assert not accel.onnxruntime_available()
    with torch.no_grad():
        fast = accel.image_features(model, images)
        text = accel.text_features(model, CAPTIONS)
        reference = model.image_tower(images)
        text_reference = model.text_tower(model.tokenize(CAPTIONS))
    assert accel.active_backend(model.image_tower) == "jit"
    assert accel.active_backend(model.text_tower) == "eager"
    assert _min_cos(fast, reference) >= MIN_COS
    assert _min_cos(text, text_reference) >= MIN_COS
    with pytest.raises(UserError, match="onnxruntime"):
        accel.inference_module(model.image_tower, "onnxruntime")


def test_eager_by_environment_and_bad_backend(model, images, monkeypatch):
    monkeypatch.setenv(accel.ENV, "eager")
    with torch.no_grad():
        out = accel.image_features(model, images[:1])
        assert torch.equal(out, model.image_tower(images[:1]))
    assert accel.active_backend(model.image_tower) == "eager"
    monkeypatch.setenv(accel.ENV, "fastest")
    with pytest.raises(UserError, match=accel.ENV):
        with torch.no_grad():
            accel.image_features(model, images[:1])


def test_other_towers_pass_through():
    tiny = build_model(ModelConfig(preset="tiny", embed_dim=8)).eval()
    assert accel.inference_module(tiny.image_tower) is tiny.image_tower
    with torch.no_grad():
        out = accel.text_features(tiny, ["a red square", "a blue circle"])
    assert out.shape[0] == 2


# ---------------------------------------------------------------------------- larger variants, tower parts


def test_lite2_fast_path_runs_at_its_own_resolution():
    """lite2's tower is exported at 260 px (not lite0's 224) and still matches eager; 224 px inputs run eager."""
    lite2 = build_model(ModelConfig(preset="lite2", embed_dim=8)).eval()
    picture = Image.new("RGB", (300, 200), (250, 250, 250))
    picture.paste((30, 30, 200), (40, 40, 160, 150))
    x = lite2.image_transform(train=False)(picture).unsqueeze(0).repeat(2, 1, 1, 1)  # (2, 3, 260, 260)
    assert x.shape == (2, 3, 260, 260) == (2, 3, lite2.image_tower.image_size, lite2.image_tower.image_size)
    with torch.no_grad():
        accel.image_features(lite2, x[:, :, :224, :224])  # lite0's size: not what lite2 was exported for
        assert accel.active_backend(lite2.image_tower) == "eager"
        reference = lite2.image_tower(x)
        fast = accel.image_features(lite2, x)
    assert accel.active_backend(lite2.image_tower) in ("onnxruntime", "jit")
    assert _min_cos(fast, reference) >= MIN_COS
    assert _min_cos(embed_pil_images(lite2, [picture], "cpu"), lite2.encode_image(x[:1]).detach()) >= MIN_COS


@pytest.mark.parametrize("backend", ["jit", pytest.param("onnxruntime", marks=needs_onnxruntime)])
def test_frozen_tower_bottom_fast_path_matches_eager(model, images, backend, monkeypatch):
    """The bottom of a partly unlocked tower (a dict out) is run fast for its one pass over the data."""
    from triclip.model.unlock import split_tower

    monkeypatch.setenv(accel.ENV, backend)
    for groups in (1, 4):
        bottom, _ = split_tower(model.image_tower, groups)
        bottom.eval()
        with torch.no_grad():
            reference = bottom(images)["x"]  # (4, C, h, w)
            fast = accel.image_module_features(bottom, images, key="x")
        assert accel.active_backend(bottom) == backend
        assert fast.shape == reference.shape and fast.dtype == torch.float32
        assert _min_cos(fast.flatten(1), reference.flatten(1)) >= MIN_COS
        with torch.no_grad():
            assert torch.equal(bottom(images)["x"], reference)  # preparing left the tower's weights alone
        assert all(p.requires_grad for p in model.image_tower.parameters())  # and its trainable flags
    eager = accel.image_module_features(bottom, images, key="x")  # autograd on: the module itself
    assert torch.equal(eager.detach(), bottom(images)["x"].detach())


def test_text_batches_cap_padded_tokens_and_cover_every_row_once(model, monkeypatch):
    """Sorted by token length; no batch over batch_size rows or MAX_TOKENS padded tokens (one long text alone)."""
    monkeypatch.setattr(accel, "MAX_TOKENS", 64)
    texts = ["word " * n for n in (40, 1, 3, 90, 2, 12, 30, 5, 7, 200)] + CAPTIONS
    lengths = [int(model.tokenize([t])["attention_mask"].sum()) for t in texts]
    batches = accel.text_batches(model, texts, batch_size=4)
    assert sorted(i for rows in batches for i in rows) == list(range(len(texts)))
    flat = [lengths[i] for rows in batches for i in rows]
    assert flat == sorted(flat)
    for rows in batches:
        assert len(rows) <= 4
        assert len(rows) == 1 or max(lengths[i] for i in rows) * len(rows) <= 64
    assert [len(rows) for rows in batches if max(lengths[i] for i in rows) > 64] == [1, 1]  # 90 and 200 words
    assert max(len(rows) for rows in batches) == 4  # short texts still fill batches


def test_token_budget_batches_embed_like_one_text_at_a_time(model, monkeypatch):
    """The optimised batching (small batches for long texts) against the reference: each text alone."""
    monkeypatch.setattr(accel, "MAX_TOKENS", 48)
    texts = ["tree " * n + f"number {n}" for n in (1, 60, 3, 25, 0, 9)] + CAPTIONS
    batched = embed_texts(model, texts, "cpu", batch_size=3)
    single = torch.cat([embed_texts(model, [t], "cpu") for t in texts])
    assert batched.shape == single.shape == (len(texts), model.embed_dim)
    assert _min_cos(batched, single) >= MIN_COS


def test_embed_texts_on_two_threads_equals_one_thread_and_prepares_one_session(model, monkeypatch):
    """embed_texts runs its batches as the text cache does (cache.text_tower_pass): on two threads each with a
    single-threaded session, the same embeddings bit for bit as one thread, in the input order, and no session of
    torch's thread count is prepared for it (the demo's evaluation exported the text tower a second time: 1.5 s);
    a single batch (a query) runs on torch's threads."""
    texts = ["tree " * n + f"number {n}" for n in (1, 12, 3, 7, 0, 9)] + CAPTIONS
    out, calls = {}, []
    for threads in (1, 2):
        monkeypatch.setattr(accel, "pass_threads", lambda tower, device, n=threads: calls.append(n) or n)
        out[threads] = embed_texts(model, texts, "cpu", batch_size=3)  # several batches
    assert calls == [1, 2] and torch.equal(out[1], out[2])
    with torch.no_grad():
        assert _min_cos(out[2], model.encode_text(texts)) >= MIN_COS
    if accel.onnxruntime_available():
        accel._PREPARED.clear()
        embed_texts(model, texts, "cpu", batch_size=3)
        assert set(accel._PREPARED[model.text_tower]) == {1}
        embed_texts(model, texts[:2], "cpu")  # one batch
        assert set(accel._PREPARED[model.text_tower]) == {0, 1}
