"""Distilled warm-start sets from a teacher classifier: SRe2L recover core, DWA, FADRM."""
