"""Serves DIRECTORY on 127.0.0.1:PORT over HTTP, for the OCI benchmark's plain-HTTP comparison.

    serve_files.py PORT DIRECTORY

A threaded file server with a listen backlog of 128: http.server's default of 5 drops the
SYNs of 10 agents fetching at once, which costs them 1 s retries."""
import functools
import http.server
import sys


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128


handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[2])
Server(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
