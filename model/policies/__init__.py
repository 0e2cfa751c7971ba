"""rlbus.model.policies: the models behind one interface.

- `interface`: `Policy` and `ChatTokenizer`, all that actors see of a model, and `build_policy` from a spec.
- `builtin` (with `transformer`, `tokenizer`): the project's transformer and byte tokenizer.
- `hf`: a local Hugging Face directory loaded through `transformers`; `hf_recipe` builds one on the spot.
- `export`: any policy written out as a directory plain `transformers` loads; `quant`: MXFP8 sampling copies.

Actors import `interface` only (tests/meta/test_meta_layering.py); nothing is re-exported here.
"""
