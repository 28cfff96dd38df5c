"""The MP4s rank 0 writes piece by piece as the decode delivers them: to a file or stdout (the command line's
:mod:`server.outputs.piece_video`) and to a served job's file that HTTP clients follow
(:mod:`server.outputs.streaming`). Below both the command line and the group's leader, which both use them."""
