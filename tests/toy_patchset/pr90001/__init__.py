"""Patchset pr90001: a toy, to show that a fix is one folder (tests only)."""

from __future__ import annotations

from gdn_backport.registry import Patchset

from .seam import Toy

PATCHSET: Patchset = Toy(__name__)
