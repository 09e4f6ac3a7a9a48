"""The bottom layer: what every other package may import, and which imports none of them.

`core` holds the policies the whole project shares, so that the library (model/ aside, which
imports only itself) and the command lines speak alike without the library depending on the
command lines: `errors.py` (the errors a user can act on and their exit status, arguments named
as Python names them), `progress.py` (numbers and a progress bar as a person reads them) and
`logs.py` (which library log lines are shown, and the calls that install that policy). The name
says its place: the core the other layers stand on, never a grab-bag; a module belongs here only
when library and command lines both need it and it needs nothing of this project.
"""
