"""The worker group: the runtime every rank runs (:mod:`server.group.runtime`), rank 0's leader of the served job
queue (:mod:`server.group.leader`), other replicas' drivers, the restart policy, the SQLite job store and the phase
marks. It imports nothing of the command line or the HTTP front end."""
