"""Themes: Textual's default dark theme on capable terminals, native ANSI colours on 16-colour
ones (SSH into an old box, the Linux console).

Why a theme of our own for 16 colours: mapping the truecolor palette down turns both the warning
orange and the error red into bright red, and the KV map's "shared" colour into "used". With
native ANSI colours warning is yellow, error red, and each block state keeps its own colour.
"""

from __future__ import annotations

import dataclasses

from textual.theme import BUILTIN_THEMES, Theme

ANSI_THEME: Theme = dataclasses.replace(BUILTIN_THEMES["ansi-dark"], name="vconsole-ansi",
                                        accent="ansi_magenta")
LOW_COLOUR_SYSTEMS = ("standard", "windows")
