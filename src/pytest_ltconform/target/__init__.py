"""Targets: what a user names (``spec``), how its objects are loaded in a process (``loading``,
on the ranks too) and how one is checked before any rank starts (``validation``). Imports none of
them: each caller imports the module it needs.
"""
