"""Writing a benchmark's results page while keeping its hand-written readings below a marker."""

from __future__ import annotations

from pathlib import Path

NOTES_MARKER = "<!-- readings: kept by --write -->"


def write_keeping_notes(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, followed by whatever the old page held from :data:`NOTES_MARKER` on (the
    readings a person wrote of earlier runs), so that ``--write`` replaces the generated tables only."""
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES_MARKER):] if NOTES_MARKER in old else NOTES_MARKER + "\n"
    path.write_text(text.rstrip("\n") + "\n\n" + notes)
