"""The HTTP front end on rank 0: the FastAPI app (:mod:`server.http.app`), the ``/v1/videos`` routes, health and
metrics, request schemas derived from the model's declared options, media checks and the playground. It reaches
the worker group only through the :class:`server.http.engine.Engine` protocol."""
