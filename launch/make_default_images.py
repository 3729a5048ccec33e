"""One-time export of the small image set shipped in launch/data/images/ (already committed).

    pip install scikit-image   # only for this script; not a dependency of mpcore
    python launch/make_default_images.py [--out launch/data/images]

Takes sample images from ``skimage.data`` whose docstrings (scikit-image 0.26) say they are in
the public domain or under CC0, shrinks each so that its longest side is the size listed below
(Lanczos), and writes photographs as JPEG (quality 90) and grey-level or line images as PNG, with
``captions.jsonl`` (one ``{"image", "caption"}`` per line, captions written from each docstring's
description) and a README naming each image's origin and license. The sizes differ on purpose, so
the set exercises several grids of each family's image processor (mpcore prepares the set once
per model family: ``mpcore.data.vl_default.default_settings``). Skipped: images whose docstrings state no license
(moon, page, colorwheel, logo) or only "no known copyright restrictions" (coins,
immunohistochemistry).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# (skimage.data name, file, longest side, caption, origin and license as its docstring gives them)
IMAGES = [
    ("astronaut", "astronaut.jpg", 256,
     "The astronaut Eileen Collins in an orange space suit, holding her helmet, beside a flag "
     "and a model of the space shuttle.",
     "NASA Great Images database; public domain (no known copyright restrictions)"),
    ("rocket", "rocket.jpg", 240,
     "A Falcon 9 rocket carrying DSCOVR on its launch pad at dusk, between lightning towers.",
     "SpaceX Photos (Flickr); released into the public domain by SpaceX"),
    ("coffee", "coffee.jpg", 224,
     "A cup of coffee on a red saucer with a spoon, on a wooden table.",
     "Pikolo Espresso Bar, photo by Rachel Michetti; CC0"),
    ("chelsea", "chelsea.jpg", 200,
     "A close-up of the face of Chelsea, a tabby cat with green eyes.",
     "photo by Stefan van der Walt; CC0"),
    ("hubble_deep_field", "hubble_deep_field.jpg", 256,
     "The Hubble eXtreme Deep Field: many small distant galaxies on a black sky.",
     "NASA, HubbleSite; public domain"),
    ("retina", "retina.jpg", 192,
     "A fundus photograph of a normal human retina: an orange disc with blood vessels.",
     "Wikimedia Commons, Mikael Haggstrom; CC0 1.0 Universal"),
    ("camera", "camera.png", 256,
     "A grey-level photograph of a man looking through a camera on a tripod, on a lawn.",
     "photo by Lav Varshney; CC0"),
    ("clock", "clock.png", 224,
     "A grey-level photograph of a wall clock, blurred by horizontal camera motion.",
     "photo by Stefan van der Walt; released into the public domain"),
    ("cell", "cell.png", 180,
     "A quantitative phase image of a single cell floating in saline, with a banded background.",
     "Paul Mueller et al., Optics Express 26(8) 2018; CC0"),
    ("horse", "horse.png", 200,
     "A black silhouette of a horse on a white background.",
     "openclipart, Andreas Preuss (marauder); CC0"),
    ("brick", "brick.png", 160,
     "A grey-level view of a wall of long, narrow bricks.",
     "CC0Textures (Bricks25); CC0"),
    ("grass", "grass.png", 160,
     "A grey-level close-up of blades of grass.",
     "DeviantArt, linolafett (Grass-01); CC0"),
    ("gravel", "gravel.png", 176,
     "A grey-level close-up of a patch of gravel.",
     "CC0Textures (Gravel04); CC0"),
    ("microaneurysms", "microaneurysms.png", 102,
     "A grey-level detail of a retina with small dark lesions (microaneurysms).",
     "High-Resolution Fundus Image Database, Andreas Maier; CC0"),
    ("text", "text.png", 256,
     "Hand-written letters and digits on a sheet of paper, seen at a slant.",
     "Wikipedia (File:Corner.png); public domain"),
]


def export(out: Path) -> int:
    """Write the images, captions.jsonl and README.md to ``out``; returns the bytes written."""
    import skimage.data
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    captions, lines = [], []
    for name, file, side, caption, origin in IMAGES:
        array = getattr(skimage.data, name)()
        if array.dtype == bool:  # a mask, False on the horse: black horse on white
            array = np.where(array, 255, 0).astype(np.uint8)
        image = Image.fromarray(array)
        scale = side / max(image.size)
        if scale < 1:
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, resample=Image.Resampling.LANCZOS)
        if file.endswith(".jpg"):
            image.convert("RGB").save(out / file, quality=90)
        else:
            image.save(out / file, optimize=True)
        captions.append({"image": file, "caption": caption})
        lines.append(f"| `{file}` | {image.width}x{image.height} {image.mode} | "
                     f"`skimage.data.{name}()` | {origin} |")
    (out / "captions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in captions))
    (out / "README.md").write_text(README.format(table="\n".join(lines)))
    return sum(f.stat().st_size for f in out.iterdir())


README = """# Default images

Small images shipped with mpcore: the default vision-language training data (with
`captions.jsonl`, one `{{"image", "caption"}}` per line; captions written for this set) and the
real images the image-processor tests run on. Made once by `launch/make_default_images.py` from
scikit-image's sample data (`skimage.data`, scikit-image 0.26), keeping only images whose
docstrings say they are public domain or CC0, downscaled with Lanczos.

| file | size, mode | source | origin and license (as stated in the skimage.data docstring) |
| --- | --- | --- | --- |
{table}

scikit-image itself is BSD-3-Clause licensed; the images above carry the licenses in the table.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "images")
    args = parser.parse_args()
    size = export(args.out)
    print(f"wrote {len(IMAGES)} images to {args.out} ({size / 1024:.0f} KiB in all)")


if __name__ == "__main__":
    main()
