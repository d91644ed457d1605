"""The CJK/Hangul typeface designs the glyph dataset draws from, and finding them on disk.

A *design* is one face we render. A *family* groups designs that share outlines (weights of one
typeface, or a font that copies another's glyphs): a held-out test design must be held out with
its whole family, or the test leaks. Families can differ per script, because some fonts borrow
only one script from another font (WenQuanYi Zen Hei's Hangul is Un Dotum). The coverage scan
additionally merges families whose glyphs turn out near-identical (``coverage.py``).

Fonts deliberately left out (see docs/data.md): IPA P-fonts and the proportional VL PGothic
(the same glyphs as their fixed-width siblings), Noto's other regional faces (mostly the same
outlines as the SC face), the Unifont variants (same bitmaps), NanumGothicCoding (derived from
NanumGothic), and Babelstone Han (reuses Ming outlines).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workers.data.errors import DatasetError

DEFAULT_FONT_DIRS = ("/usr/share/fonts",)
FONT_PACKAGES_FILE = "scripts/debian-fonts.txt"
SETUP_COMMAND = "sudo apt-get update && sudo xargs -a scripts/debian-fonts.txt apt-get install -y"

# Scripts we draw classes from, as inclusive code point ranges.
SCRIPT_RANGES: dict[str, tuple[tuple[int, int], ...]] = {
    "han": (
        (0x4E00, 0x9FFF),    # CJK Unified Ideographs (URO)
        (0x3400, 0x4DBF),    # Extension A
        (0x20000, 0x2A6DF),  # Extension B
        (0x2A700, 0x2EE5F),  # Extensions C-F, I
        (0x30000, 0x323AF),  # Extensions G-H
    ),
    "hangul": ((0xAC00, 0xD7A3),),  # the 11,172 precomposed syllables
}


def script_of(code_point: int) -> str | None:
    """``"han"``, ``"hangul"`` or None for a code point outside the ranges we use."""
    for script, ranges in SCRIPT_RANGES.items():
        for lo, hi in ranges:
            if lo <= code_point <= hi:
                return script
    return None


@dataclass(frozen=True)
class Design:
    """One face: ``file`` is the font's file name, found under the font directories."""

    name: str
    file: str
    family: str
    face_index: int = 0
    # script -> family for scripts this font borrowed from another typeface.
    family_by_script: dict[str, str] = field(default_factory=dict)

    def family_for(self, script: str) -> str:
        return self.family_by_script.get(script, self.family)


DESIGNS: tuple[Design, ...] = (
    # fonts-noto-cjk: face 2 of each collection is the Simplified Chinese (SC) face.
    Design("noto-sans-sc", "NotoSansCJK-Regular.ttc", "noto-sans", 2),
    Design("noto-sans-sc-bold", "NotoSansCJK-Bold.ttc", "noto-sans", 2),
    Design("noto-serif-sc", "NotoSerifCJK-Regular.ttc", "noto-serif", 2),
    Design("noto-serif-sc-bold", "NotoSerifCJK-Bold.ttc", "noto-serif", 2),
    Design("arphic-ukai", "ukai.ttc", "arphic-ukai"),
    Design("arphic-uming", "uming.ttc", "arphic-uming"),
    Design("wqy-zenhei", "wqy-zenhei.ttc", "wqy-zenhei", family_by_script={"hangul": "un-dotum"}),
    Design("hanazono-a", "HanaMinA.ttf", "hanazono"),
    Design("hanazono-b", "HanaMinB.ttf", "hanazono"),
    Design("ipa-gothic", "ipag.ttf", "ipa-gothic"),
    Design("ipa-mincho", "ipam.ttf", "ipa-mincho"),
    Design("vl-gothic", "VL-Gothic-Regular.ttf", "vl-gothic"),
    Design("unifont", "unifont.otf", "unifont"),
    Design("baekmuk-batang", "batang.ttf", "baekmuk-batang"),
    Design("baekmuk-dotum", "dotum.ttf", "baekmuk-dotum"),
    Design("baekmuk-gulim", "gulim.ttf", "baekmuk-gulim"),
    Design("baekmuk-headline", "hline.ttf", "baekmuk-headline"),
    Design("nanum-gothic", "NanumGothic.ttf", "nanum-gothic"),
    Design("nanum-gothic-bold", "NanumGothicBold.ttf", "nanum-gothic"),
    Design("nanum-barun-gothic", "NanumBarunGothic.ttf", "nanum-barun-gothic"),
    Design("nanum-myeongjo", "NanumMyeongjo.ttf", "nanum-myeongjo"),
    Design("nanum-myeongjo-bold", "NanumMyeongjoBold.ttf", "nanum-myeongjo"),
    Design("nanum-square", "NanumSquareR.ttf", "nanum-square"),
    Design("nanum-square-round", "NanumSquareRoundR.ttf", "nanum-square-round"),
    Design("un-batang", "UnBatang.ttf", "un-batang"),
    Design("un-dotum", "UnDotum.ttf", "un-dotum"),
    Design("un-graphic", "UnGraphic.ttf", "un-graphic"),
    Design("un-gungseo", "UnGungseo.ttf", "un-gungseo"),
    Design("un-pilgi", "UnPilgi.ttf", "un-pilgi"),
    Design("un-dinaru", "UnDinaru.ttf", "un-dinaru"),
)


@dataclass(frozen=True)
class FontFile:
    """A design found on disk; ``mtime_ns`` and ``size`` key the coverage cache."""

    design: Design
    path: Path
    mtime_ns: int
    size: int

    @property
    def cache_key(self) -> str:
        return f"{self.path}|{self.design.face_index}|{self.mtime_ns}|{self.size}"


def find_fonts(font_dirs: tuple[str | Path, ...] = DEFAULT_FONT_DIRS) -> list[FontFile]:
    """The designs of ``DESIGNS`` present under ``font_dirs`` (searched recursively), in
    ``DESIGNS`` order.

    Raises DatasetError naming the packages and the setup command when none are found.
    """
    by_name: dict[str, Path] = {}
    for root in font_dirs:
        root = Path(root)
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                by_name.setdefault(path.name, path)
    found = []
    for design in DESIGNS:
        path = by_name.get(design.file)
        if path is not None and path.is_file():
            st = path.stat()
            found.append(FontFile(design, path, st.st_mtime_ns, st.st_size))
    if not found:
        dirs = ", ".join(str(d) for d in font_dirs)
        raise DatasetError(
            f"no CJK/Hangul fonts found under {dirs}. Install the Debian font packages listed in "
            f"{FONT_PACKAGES_FILE} (fonts-noto-cjk, fonts-arphic-ukai, fonts-nanum, ...): "
            f"{SETUP_COMMAND}")
    return found
