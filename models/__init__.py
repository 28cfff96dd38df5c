"""Model definitions and adapters: which diffusers classes, which config, how they are loaded and parallelised.

One package per family (``models.ltx_video``, ``models.ltx2``, ``models.wan``) over the shared ``models.common``;
``models.families`` is the one table of families and ``models.registry`` the entry point from a folder to a parallel
adapter. The model maths stays free of parallelism; the engine in ``cp_infer`` applies it afterwards. Nothing heavy
is imported here, so ``import models`` stays cheap; import the submodule you need (``models.registry``,
``models.common.loading``, ``models.ltx_video.default``).
"""
