"""Image-text data: manifest schema, prepare round trip, VL packing, collate, loader, blend."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpcore.data import (
    BlendedDataset,
    ImageSettings,
    IndexedDataset,
    PackedDataset,
    TextAsVL,
    VLDataLoader,
    VLDataset,
    VLPackedDataset,
    VLTokenizer,
    collate_vl,
    prepare_default,
    prepare_vl_dataset,
    prepare_vl_default,
)
from mpcore.data.images import load_image, process_image
from mpcore.data.vl_default import DEFAULT_MANIFEST, DEFAULT_SETTINGS
from mpcore.launch import prepare_vl_data

SMALL = ImageSettings(min_pixels=28 * 28, max_pixels=4 * 28 * 28)  # 1 to 4 tokens per image


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl_data")
    prepare_default(path)
    return path


@pytest.fixture(scope="module")
def tok(data_dir):
    return VLTokenizer(prepare_default(data_dir)[0])


def make_images(folder: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    out = {}
    for name, (h, w) in {"a.png": (40, 60), "b.jpg": (90, 30), "c.png": (28, 28)}.items():
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out[name] = folder / name
        Image.fromarray(arr).save(out[name])
    return out


def write_manifest(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


GOOD = [
    {"image": "a.png", "caption": "A noisy picture."},
    {
        "content": [
            {"text": "Question: what is it?", "target": False},
            {"image": "b.jpg"},
            {"text": " Noise, and then"},
            {"image": "c.png"},
            {"text": " more noise."},
        ]
    },
    {"text": "Only text here."},
    {"image": "c.png", "caption": "Small.", "max_pixels": 28 * 28},
]


@pytest.fixture
def prepared(tmp_path, tok):
    make_images(tmp_path)
    manifest = write_manifest(tmp_path / "m.jsonl", GOOD)
    return manifest, prepare_vl_dataset(manifest, tmp_path / "out", tok, SMALL, progress=False)


# ---------------------------------------------------------------- schema errors


BAD = [
    ("not json {", "not JSON"),
    ({"image": "a.png", "caption": "x", "lable": 1}, r"unknown keys \['lable'\]"),
    ({"image": "a.png", "caption": ""}, "caption is empty"),
    ({"text": "   "}, "text is empty"),
    ({"image": "a.png"}, r"needs \['caption'\]"),
    ({"content": []}, "non-empty list"),
    ({"content": [{"image": "a.png"}]}, "no target text"),
    ({"content": [{"text": "x", "img": 1}]}, r"content\[0\] has keys"),
    ({"foo": 1}, "fit no sample kind"),
    ({"image": "a.png", "caption": "x", "max_pixels": -3}, "max_pixels must be a positive"),
    ({"image": "missing.png", "caption": "x"}, "does not exist"),
    ({"image": "notes.png", "caption": "x"}, "not a readable image"),
    ({"image": "anim.gif", "caption": "x"}, "is GIF, not PNG or JPEG"),
    ([1, 2], "expected a JSON object"),
]


@pytest.mark.parametrize("line,match", BAD)
def test_manifest_errors_name_file_line_and_write_nothing(tmp_path, tok, line, match):
    make_images(tmp_path)
    (tmp_path / "notes.png").write_text("not an image")
    Image.new("RGB", (28, 28)).save(tmp_path / "anim.gif")
    manifest = write_manifest(tmp_path / "m.jsonl", [GOOD[0], "", line])
    with pytest.raises(ValueError, match=rf"{manifest}:3: .*{match}"):
        prepare_vl_dataset(manifest, tmp_path / "out", tok, SMALL, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == []


def test_manifest_errors_are_all_reported(tmp_path, tok):
    make_images(tmp_path)
    manifest = write_manifest(
        tmp_path / "m.jsonl", ["{", GOOD[0], {"text": ""}, {"image": "nope.jpg", "caption": "x"}]
    )
    with pytest.raises(ValueError, match="3 problem") as e:
        prepare_vl_dataset(manifest, tmp_path / "out", tok, SMALL, progress=False)
    for line in (1, 3, 4):
        assert f"{manifest}:{line}:" in str(e.value)


def test_no_resize_rejects_images_over_the_limit(tmp_path, tok):
    make_images(tmp_path)
    manifest = write_manifest(
        tmp_path / "m.jsonl",
        [{"image": "c.png", "caption": "ok"}, {"image": "a.png", "caption": "x"}],
    )
    fixed = ImageSettings(min_pixels=28 * 28, max_pixels=28 * 28, resize=False)
    with pytest.raises(ValueError, match=rf"{manifest}:2: .*multiples of patch_size"):
        prepare_vl_dataset(manifest, tmp_path / "out", tok, fixed, progress=False)
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "a.png")
    with pytest.raises(ValueError, match=rf"{manifest}:2: .*over max_pixels=784"):
        prepare_vl_dataset(manifest, tmp_path / "out", tok, fixed, progress=False)


def test_corrupt_image_body_fails_with_line_and_leaves_nothing(tmp_path, tok):
    make_images(tmp_path)
    data = (tmp_path / "a.png").read_bytes()
    (tmp_path / "a.png").write_bytes(data[: len(data) // 2])  # header fine, pixels cut
    manifest = write_manifest(tmp_path / "m.jsonl", [GOOD[2], GOOD[0]])
    with pytest.raises(ValueError, match=rf"{manifest}:2: .*a.png"):
        prepare_vl_dataset(manifest, tmp_path / "out", tok, SMALL, progress=False)
    assert not any("out" in p.name for p in tmp_path.iterdir())


# ---------------------------------------------------------------- prepare round trip


def test_prepare_round_trip(prepared, tok):
    manifest, out = prepared
    ds = VLDataset(out)
    assert len(ds) == 4 and ds.tokenizer.token_ids() == tok.token_ids()
    assert ds.meta["num_images"] == 4 and ds.patch_dim == 3 * 2 * 14 * 14
    folder = manifest.parent
    vs, ve, pad, eos = tok.vision_start_id, tok.vision_end_id, tok.image_pad_id, tok.eos_id

    def image_part(name, sample, k, max_pixels=SMALL.max_pixels):
        rows, grid = process_image(
            load_image(folder / name), min_pixels=SMALL.min_pixels, max_pixels=max_pixels
        )
        assert list(sample.grid_thw[k]) == list(grid)
        n = int(np.prod(grid)) // 4
        return [vs, *[pad] * n, ve], [0] * (n + 2), rows

    def check(i, parts, max_pixels=SMALL.max_pixels):
        s = ds[i]
        ids, mask, rows, k = [], [], [], 0
        for kind, value, target in parts:
            if kind == "image":
                a, b, r = image_part(value, s, k, max_pixels)
                ids, mask, k = ids + a, mask + b, k + 1
                rows.append(r)
            else:
                enc = tok.encode(value)
                ids, mask = ids + enc, mask + [int(target)] * len(enc)
        assert s.input_ids.tolist() == ids + [eos]
        assert s.loss_mask.tolist() == [bool(m) for m in mask + [1]]
        assert s.input_ids.dtype == np.int64 and s.grid_thw.dtype == np.int64
        assert s.pixel_values.dtype == np.float32 and s.grid_thw.shape == (k, 3)
        want = torch.cat(rows).numpy() if rows else np.zeros((0, ds.patch_dim), np.float32)
        np.testing.assert_array_equal(s.pixel_values, want)  # float32 store: exact

    check(0, [("image", "a.png", 0), ("text", "A noisy picture.", 1)])
    check(
        1,
        [
            ("text", "Question: what is it?", 0),
            ("image", "b.jpg", 0),
            ("text", " Noise, and then", 1),
            ("image", "c.png", 0),
            ("text", " more noise.", 1),
        ],
    )
    check(2, [("text", "Only text here.", 1)])
    check(3, [("image", "c.png", 0), ("text", "Small.", 1)], max_pixels=28 * 28)
    assert ds.describe(3) == f"sample 3 ({manifest.resolve()}:4)"
    assert VLTokenizer.load(out).to_json() == ds.meta["tokenizer"]


def test_float16_store_error_and_overwrite(prepared, tok):
    manifest, out = prepared
    with pytest.raises(ValueError, match="already exists"):
        prepare_vl_dataset(manifest, out, tok, SMALL, progress=False)
    half = ImageSettings(**{**SMALL.__dict__, "pixel_dtype": "float16"})
    prepare_vl_dataset(manifest, out, tok, half, overwrite=True, progress=False)
    ds = VLDataset(out)
    assert ds.meta["pixel_dtype"] == "float16"
    rows, _ = process_image(
        load_image(manifest.parent / "a.png"),
        min_pixels=SMALL.min_pixels,
        max_pixels=SMALL.max_pixels,
    )
    err = np.abs(ds[0].pixel_values - rows.numpy()).max()
    assert 0 < err <= 1e-3, err  # CLIP-normalised values lie in [-1.8, 2.2]: ulp 2^-10 at 2
    assert not any(".out" in p.name for p in out.parent.iterdir())  # no temp folders left


def test_truncated_dataset_is_rejected(prepared):
    _, out = prepared
    pixels = out / "pixels.bin"
    pixels.write_bytes(pixels.read_bytes()[:-4])
    with pytest.raises(ValueError, match="pixels.bin.*prepare it again"):
        VLDataset(out)


def test_cli(tmp_path, tok, capsys):
    make_images(tmp_path)
    manifest = write_manifest(tmp_path / "m.jsonl", GOOD)
    argv = [
        "--manifest",
        str(manifest),
        "--tokenizer",
        str(tok.path),
        "--out",
        str(tmp_path / "out"),
        "--max-pixels",
        str(4 * 28 * 28),
        "--min-pixels",
        "784",
    ]
    assert prepare_vl_data.main(argv) == 0
    assert "4 samples, 4 images" in capsys.readouterr().out
    assert prepare_vl_data.main(argv) == 2
    assert "already exists" in capsys.readouterr().err


def test_default_dataset(data_dir, tok, capsys):
    capsys.readouterr()
    first = prepare_vl_default(data_dir)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"prepared the default image set in "
                                                 f"{first.dataset} (first use")
    stamp = (first.dataset / "meta.json").stat().st_mtime_ns
    again = prepare_vl_default(data_dir)
    assert capsys.readouterr().out == ""  # found in the cache: nothing to say
    assert again == first and (first.dataset / "meta.json").stat().st_mtime_ns == stamp
    ds = VLDataset(first.dataset)
    captions = [json.loads(x)["caption"] for x in DEFAULT_MANIFEST.read_text().splitlines()]
    assert len(ds) == len(captions) == 15
    for i, caption in enumerate(captions):
        s = ds[i]
        n = int(np.prod(s.grid_thw)) // 4
        assert 16 <= n <= 32 and s.loss_mask.sum() == len(tok.encode(caption)) + 1
        assert s.input_ids[s.loss_mask].tolist() == tok.encode(caption) + [tok.eos_id]
    assert DEFAULT_SETTINGS.max_pixels == 32 * 28 * 28


# ---------------------------------------------------------------- packing


class FakeVL:
    """Samples with a unique first id (1000 + i), images of random grids with rows = i."""

    def __init__(self, num, seed=0, patch_dim=6, max_len=30):
        rng = np.random.default_rng(seed)
        self.samples = []
        for i in range(num):
            grids = [(1, 2 * int(rng.integers(1, 3)), 2) for _ in range(int(rng.integers(0, 3)))]
            ids = [1000 + i]
            for g in grids:
                ids += [7, *[5] * (int(np.prod(g)) // 4), 8]
            ids += list(rng.integers(10, 20, int(rng.integers(1, max_len // 2)))) + [2]
            rows = sum(int(np.prod(g)) for g in grids)
            self.samples.append(
                (
                    np.array(ids),
                    np.arange(len(ids)) % 2 == 0,
                    np.full((rows, patch_dim), i, np.float32),
                    np.array(grids, np.int64).reshape(-1, 3),
                )
            )
        self.lengths = np.array([len(s[0]) for s in self.samples])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


@pytest.mark.parametrize("seed,seq_len", [(0, 32), (1, 40), (2, 64)])
def test_packing_invariants(seed, seq_len):
    ds = FakeVL(60, seed)
    packed = VLPackedDataset(ds, seq_len, seed, pad_id=3)
    seen = []
    for b in range(len(packed)):
        s = packed[b]
        assert s.input_ids.shape == s.loss_mask.shape == s.position_ids.shape == (seq_len,)
        cu = s.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == seq_len and s.cu_seqlens.dtype == np.int32
        members = packed.members(b).tolist()
        for k, i in enumerate(members):  # each segment is one whole sample
            a, z = cu[k], cu[k + 1]
            np.testing.assert_array_equal(s.input_ids[a:z], ds[i][0])
            np.testing.assert_array_equal(s.loss_mask[a:z], ds[i][1])
            assert s.position_ids[a] == 0
        if len(cu) - 1 > len(members):  # the padding segment
            assert (s.input_ids[cu[-2] :] == 3).all() and not s.loss_mask[cu[-2] :].any()
        else:
            assert cu[-2] == sum(len(ds[i][0]) for i in members[:-1])
        # pixels and grids travel with their samples; runs match grids (no image split)
        want_rows = np.concatenate([ds[i][2] for i in members])
        np.testing.assert_array_equal(s.pixel_values, want_rows)
        assert s.image_grid_thw.tolist() == sum((ds[i][3].tolist() for i in members), [])
        assert (s.input_ids == 5).sum() == sum(int(np.prod(g)) // 4 for g in s.image_grid_thw)
        seen += members
    assert sorted(seen) == list(range(len(ds)))  # every sample exactly once
    assert packed.num_tokens == ds.lengths.sum()
    assert packed.num_pad_tokens == len(packed) * seq_len - ds.lengths.sum()
    again = VLPackedDataset(ds, seq_len, seed, pad_id=3)
    assert np.array_equal(again.budget_samples, packed.budget_samples)
    other = VLPackedDataset(ds, seq_len, seed + 10, pad_id=3)
    assert not np.array_equal(other.budget_samples, packed.budget_samples)


def test_long_samples_error_or_are_dropped_and_counted(prepared):
    ds = FakeVL(20, 3, max_len=60)
    seq_len = 20
    long = np.flatnonzero(ds.lengths > seq_len)
    assert len(long) >= 2
    first = int(long[0])
    with pytest.raises(
        ValueError,
        match=rf"sample {first} has {ds.lengths[first]} tokens, "
        rf"more than seq_len=20 \({len(long)} such",
    ):
        VLPackedDataset(ds, seq_len, 0, pad_id=3)
    packed = VLPackedDataset(ds, seq_len, 0, pad_id=3, drop_long=True)
    assert packed.num_dropped == len(long)
    assert packed.num_dropped_tokens == ds.lengths[long].sum()
    assert sorted(packed.budget_samples.tolist()) == sorted(set(range(20)) - set(long.tolist()))
    vl = VLDataset(prepared[1])  # a real dataset names the manifest line
    with pytest.raises(ValueError, match=r"sample \d \(.*m.jsonl:\d\) has \d+ tokens"):
        VLPackedDataset(vl, 8, 0, pad_id=vl.tokenizer.eos_id)
    with pytest.raises(ValueError, match="must be a text id"):
        VLPackedDataset(vl, 64, 0, pad_id=vl.tokenizer.image_pad_id)


def test_collate_vl_shapes_and_offsets():
    ds = FakeVL(30, 4)
    packed = VLPackedDataset(ds, 40, 0, pad_id=3)
    samples = [packed[b] for b in range(3)]
    batch = collate_vl(samples)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (120,)
    assert batch["input_ids"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.bool
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["image_grid_thw"].dtype == torch.int64
    want_cu = [0]
    for b, s in enumerate(samples):
        want_cu += (s.cu_seqlens[1:].astype(np.int64) + 40 * b).tolist()
    assert batch["cu_seqlens"].tolist() == want_cu
    np.testing.assert_array_equal(
        batch["pixel_values"].numpy(), np.concatenate([s.pixel_values for s in samples])
    )
    assert batch["image_grid_thw"].tolist() == sum((s.image_grid_thw.tolist() for s in samples), [])


def first_ids(batch):
    """The sample ids (1000 + i) in a micro-batch of FakeVL budgets."""
    ids = batch["input_ids"][batch["cu_seqlens"][:-1].long()]
    return {int(i) for i in ids if i >= 1000}


def test_loader_resumes_and_dp_ranks_are_disjoint():
    packed = VLPackedDataset(FakeVL(200, 5), 48, 0, pad_id=3)
    straight = VLDataLoader(packed, 2, 2, 1, 0, seed=7)
    batches = [next(straight) for _ in range(10)]
    resumed = VLDataLoader(packed, 2, 2, 1, 0, seed=7)
    for _ in range(4):
        next(resumed)
    state = resumed.state_dict()
    fresh = VLDataLoader(packed, 2, 2, 1, 0, seed=7)
    fresh.load_state_dict(state)
    for want in batches[4:]:
        got = next(fresh)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    ranks = [VLDataLoader(packed, 2, 1, 2, r, seed=7) for r in range(2)]
    for _ in range(3):
        a, b = (first_ids(next(loader)) for loader in ranks)
        assert a and b and not a & b


def test_blend_with_text_only(prepared, data_dir, tok):
    manifest, out = prepared
    vl = VLDataset(out)
    # packed level: the default text corpus, every token a target, no images
    text = TextAsVL(
        PackedDataset(IndexedDataset(prepare_default(data_dir)[1]), 64, tok.eos_id), vl.patch_dim
    )
    image = VLPackedDataset(vl, 64, 0, pad_id=tok.eos_id)
    blend = BlendedDataset([image, text], [0.5, 0.5], seed=1, num_samples=8)
    loader = VLDataLoader(blend, 4, 1, 1, 0, seed=1)
    batch = next(loader)
    assert batch["pixel_values"].shape[1] == vl.patch_dim
    num_pad = int((batch["input_ids"] == tok.image_pad_id).sum())
    assert num_pad == sum(int(np.prod(g)) // 4 for g in batch["image_grid_thw"].tolist())
    assert int(batch["input_ids"].max()) < tok.vocab_size
    # sample level: a text-only manifest is a VL dataset without images
    text_manifest = write_manifest(
        manifest.parent / "t.jsonl", [{"text": f"Document number {i}."} for i in range(6)]
    )
    text_ds = VLDataset(
        prepare_vl_dataset(text_manifest, manifest.parent / "t", tok, SMALL, progress=False)
    )
    assert text_ds.meta["num_images"] == 0 and text_ds[0].pixel_values.shape == (0, 1176)
    samples = BlendedDataset([vl, text_ds], [1, 1], seed=2)
    mixed = VLPackedDataset(samples, 96, 0, tok.eos_id)
    assert mixed.num_docs == 10 and mixed.num_tokens == sum(len(samples[j][0]) for j in range(10))
    got = collate_vl([mixed[b] for b in range(len(mixed))])
    drawn = samples.sample_index[samples.dataset_index == 0]
    assert len(got["image_grid_thw"]) == sum(len(vl[int(i)].grid_thw) for i in drawn)


def test_batches_feed_the_vl_model_inputs(prepared, tok):
    from mpcore.models.common.config import ModelConfig
    from mpcore.models.qwen2_vl.config import VLConfig
    from mpcore.models.qwen2_vl.inputs import vl_inputs
    from mpcore.models.qwen2_vl.vision_config import VisionConfig

    vl = VLDataset(prepared[1])
    packed = VLPackedDataset(vl, 64, 0, pad_id=tok.eos_id)
    batch = collate_vl([packed[b] for b in range(len(packed))])
    text = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        qkv_bias=True,
        mrope_section=(2, 3, 3),
    )
    vision = VisionConfig(
        arch="qwen2_vl",
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
    )
    cfg = VLConfig(text=text, vision=vision, **tok.token_ids())
    out = vl_inputs(
        batch["input_ids"],
        batch["cu_seqlens"],
        cfg,
        image_grid_thw=batch["image_grid_thw"],
        loss_mask=batch["loss_mask"],
    )
    labels = out["labels"]
    assert not torch.isin(labels, torch.tensor(tok.placeholder_ids)).any()
    assert int((out["vision_rows"] >= 0).sum()) == vl.meta["num_image_tokens"]
    # every target is a loss_mask token, and every loss_mask token but a segment's first is one
    targets = int((labels != -100).sum())
    firsts = int(batch["loss_mask"][batch["cu_seqlens"][:-1].long()].sum())
    assert targets == int(batch["loss_mask"].sum()) - firsts == vl.meta["num_target_tokens"] - 1
