"""Turn an image-text (and video-text) JSONL manifest into a prepared VL dataset folder.

    python launch/prepare_vl_data.py --manifest data/train.jsonl --tokenizer T --out data/vl \\
        [--family qwen2_vl|qwen3_vl|glm4v] [--min-pixels N] [--max-pixels N] [--patch-size P] \\
        [--temporal-patch-size 2] [--merge-size 2] [--no-resize] \\
        [--video-min-pixels N] [--video-max-pixels N] \\
        [--pixel-dtype float32|float16] [--overwrite]

``--family``: the model family the data is for (default qwen2_vl). Images are processed as that
family's transformers image processor does (``Family.image_processing``: Qwen2VLImageProcessor
with patch 14 for qwen2_vl; the same processor with patch 16 and mean = std = 0.5 for qwen3_vl;
Glm4vImageProcessor's own resize rule for glm4v), so each image's rows and grid are what that
processor gives. The size and patch options default to the family's processor; set the patch
sizes to the model's vision tower when it differs. The folder records the family (and its
fingerprint covers it): a run of another family refuses it.

Videos (a manifest item ``{"video": [frame files]}``, see mpcore/data/vl_manifest.py) follow the
family's transformers video processor (``Family.image_processing.video``: Qwen2VLVideoProcessor,
Qwen3VLVideoProcessor, Glm4vVideoProcessor on pre-sampled frames; mpcore/data/videos.py): its
resize rule and per-frame pixel bounds (``--video-min-pixels`` / ``--video-max-pixels``, default
the processor's), the patch sizes above, and the family's text layout (Qwen3-VL and GLM-4V write
each temporal patch's timestamp between the frames).

``T``: a released checkpoint's folder (or its ``tokenizer.json``: the ``tokenizers`` format of
the Hugging Face Hub, with config.json beside it), a SentencePiece ``.model`` (the four VL ids
are appended after its vocab), a prepared dataset's ``tokenizer.json``, or ``default`` (the
default corpus's model, prepared under ``--data-dir`` on first use).

With a released folder the manifest holds VL conversations (``{"messages": [...]}`` with
image parts and video parts as frame lists, mpcore/data/vl_chat.py): rendered with the
release's chat template, each image's and video's placeholder expanded by the family's
processor rules, the release's OWN vision token ids (its config.json's), an assistant-only loss
mask; ``--family`` defaults to the release's, the image settings to its
preprocessor_config.json, the video settings to its video processor config
(video_preprocessor_config.json, else preprocessor_config.json, as transformers reads them;
``--video-min-pixels`` / ``--video-max-pixels`` override its bounds). The manifest schema is in mpcore/data/vl_manifest.py (and
launch/data/images/README.md); the folder layout in mpcore/data/vl_dataset.py. The manifest is
checked first (every problem reported as ``file:line``, nothing written), then streamed with a
progress line on stderr; the folder appears only when complete. Also runs as
``python -m mpcore.launch.prepare_vl_data``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpcore.data.corpus import prepare_default
from mpcore.data.videos import VideoSettings
from mpcore.data.vl_chat import is_conversation_file, prepare_vl_conversations
from mpcore.data.vl_dataset import VLDataset, prepare_vl_dataset
from mpcore.data.vl_manifest import ImageSettings
from mpcore.data.vl_release import is_release_tokenizer
from mpcore.io_errors import writing
from mpcore.models import FAMILIES, family_named
from mpcore.vl_release import (
    release_family,
    release_image_settings,
    release_video_settings,
    release_vl_tokenizer,
)

VL_FAMILIES = sorted(name for name, f in FAMILIES.items() if f.modality == "image-text")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--manifest", type=Path, required=True, help="the JSONL manifest")
    parser.add_argument(
        "--tokenizer", required=True,
        help="a released checkpoint folder (tokenizer.json + config.json), a SentencePiece "
             ".model, a prepared dataset's tokenizer.json, or 'default'"
    )
    parser.add_argument("--out", type=Path, required=True, help="dataset folder to write")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("runs/data"),
        help="where --tokenizer default is prepared",
    )
    parser.add_argument("--vocab-size", type=int, default=2048, help="vocab of --tokenizer default")
    parser.add_argument("--family", choices=sorted(FAMILIES), default=None,
                        help="model family whose image processor the data follows (default: "
                             "a released --tokenizer's own, else qwen2_vl); training another "
                             "family refuses the data")
    family = "(default: the family's processor)"
    parser.add_argument("--min-pixels", type=int, help=f"resize lower bound {family}")
    parser.add_argument("--max-pixels", type=int, help=f"resize upper bound {family}")
    parser.add_argument("--patch-size", type=int, help=f"vision patch side {family}")
    parser.add_argument("--temporal-patch-size", type=int, help=f"frames per patch {family}")
    parser.add_argument("--merge-size", type=int, help=f"merger window side {family}")
    parser.add_argument(
        "--no-resize",
        action="store_true",
        help="use images at their own size (multiples of patch*merge)",
    )
    video = "(default: the family's video processor)"
    parser.add_argument("--video-min-pixels", type=int, help=f"video frame lower bound {video}")
    parser.add_argument("--video-max-pixels", type=int, help=f"video frame upper bound {video}")
    parser.add_argument("--pixel-dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser.parse_args(argv)


def _image_overrides(args: argparse.Namespace) -> dict:
    return dict(patch_size=args.patch_size, temporal_patch_size=args.temporal_patch_size,
                merge_size=args.merge_size, min_pixels=args.min_pixels,
                max_pixels=args.max_pixels, resize=not args.no_resize,
                pixel_dtype=args.pixel_dtype)


def prepare_release(args: argparse.Namespace) -> Path:
    """VL conversations with a released tokenizer folder (module docstring)."""
    family = family_named(args.family) if args.family else release_family(args.tokenizer)
    tok = release_vl_tokenizer(args.tokenizer, family)
    if not is_conversation_file(args.manifest):
        raise ValueError(f"{args.manifest}:1: with a released tokenizer the manifest holds VL "
                         f'conversations ({{"messages": [...]}}, mpcore/data/vl_chat.py); for '
                         f"caption lines pass a SentencePiece --tokenizer")
    settings = release_image_settings(args.tokenizer, family, **_image_overrides(args))
    video = release_video_settings(args.tokenizer, family, settings,
                                   min_pixels=args.video_min_pixels,
                                   max_pixels=args.video_max_pixels)
    with writing(args.out, "--out"):  # a read-only or full disk: one line
        return prepare_vl_conversations(args.manifest, args.out, tok, settings,
                                        overwrite=args.overwrite, video=video)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.tokenizer != "default" and is_release_tokenizer(args.tokenizer):
            out = prepare_release(args)
            return _report(out, VLDataset(out).settings.family)
        if args.manifest.is_file() and is_conversation_file(args.manifest):
            raise ValueError(f"{args.manifest}:1: VL conversations need a released tokenizer "
                             f"folder (--tokenizer FOLDER with tokenizer.json and config.json), "
                             f"whose chat template and vision ids they use")
        family = family_named(args.family or "qwen2_vl")
        if family.modality != "image-text":
            raise ValueError(f"--family {family.name} is a text family; image-text data needs "
                             f"one of {', '.join(VL_FAMILIES)}")
        settings = ImageSettings.for_family(family, **_image_overrides(args))
        video = None
        if family.image_processing.video is not None:
            video = VideoSettings.for_family(family, min_pixels=args.video_min_pixels,
                                             max_pixels=args.video_max_pixels)
        tokenizer = args.tokenizer
        if tokenizer == "default":
            tokenizer = prepare_default(args.data_dir, args.vocab_size)[0]
        with writing(args.out, "--out"):  # a read-only or full disk: one line
            out = prepare_vl_dataset(args.manifest, args.out, tokenizer, settings,
                                     overwrite=args.overwrite, video=video)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _report(out, family.name)


def _report(out: Path, family: str) -> int:
    m = VLDataset(out).meta
    print(
        f"{out}: {m['num_samples']} samples, {m['num_images']} images, {m['num_videos']} "
        f"videos, {m['num_tokens']} tokens ({m['num_image_tokens']} image and "
        f"{m['num_video_tokens']} video placeholders, {m['num_target_tokens']} targets), vocab "
        f"{m['tokenizer']['vocab_size']}, images and videos as {family}'s processors"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
