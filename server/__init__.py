"""cp-infer's server side, in wings that import only downward:

- ``server.cli``: the ``cp-infer`` command line (``generate``, ``batch``, ``serve``, the ``--nproc`` launcher).
- ``server.http``: the HTTP front end on rank 0 (the FastAPI app, request schemas, media checks, the playground).
- ``server.group``: the worker group (the runtime every rank runs, rank 0's leader, replicas, restarts, the job
  store, phase marks).
- ``server.outputs``: the MP4 writers that both the command line and the group's leader use.

``cli -> http -> group -> outputs -> models -> cp_infer``; ``tests/test_import_graph.py`` holds it so.
"""
