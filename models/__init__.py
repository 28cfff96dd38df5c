"""Model definitions and adapters: which diffusers classes, which config, how they are loaded.

The model maths stays free of parallelism; the engine in `cp_infer` applies it afterwards. Nothing heavy is
imported here, so `import models` stays cheap; import the submodule you need (`models.common.loading`,
`models.ltx_video.default`, `models.common.tokenizer`).
"""
