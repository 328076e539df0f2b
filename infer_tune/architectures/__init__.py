"""Architecture presets: the published config.json of models people run, shipped without weights.

`--weights random` builds a model from one of these (or any config) with seeded random weights
(models.py, docs/commands.md "Random weights"). Each file is `<preset>.json`; its `_source` key
names the checkpoint whose config it reproduces and is dropped before the config is built.
"""
