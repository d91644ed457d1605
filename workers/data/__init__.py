"""The worker's data layer: LMDB image datasets, the glyph dataset builder, importers."""
