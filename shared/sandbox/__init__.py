"""Running code a model wrote: the backend protocol and limits (base.py), one module per backend
(bubblewrap.py, docker.py, unsafe_local.py; chosen by backends.get_backend), the sandbox's host uid
(host_uids.py), Python tools for the bubblewrap sandbox (python_tools.py), and the one hardened git
workspace that the coding tools and the grader share (workspace.py).
"""
