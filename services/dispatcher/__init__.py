"""The dispatcher service: issues prompt groups under the staleness gate (`rollstream-dispatcher`).
"""
