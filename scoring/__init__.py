"""kvroute scoring: everything that decides where a request goes.

Pure decision logic (block chains, policies, replay) plus the index backends.
No network code here except the Redis index backend.
"""
