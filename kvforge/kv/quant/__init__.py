"""Quantized KV formats: codecs (how a block of rows becomes codes) and the layer storage that uses them.

Each user-facing format lives in its own file (fp8, int8, int4, kivi2) and registers itself
in `KVFormat.registry` (kvforge.kv.layer_format) when imported; `kvforge.kv.formats` imports them all.
"""
