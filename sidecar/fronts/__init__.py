"""Everything that touches a wire: the HTTP listener (httptools fast path + aiohttp routes), generate
and generate_stream, the gRPC server, and the connection pool to Triton. Fronts decode, call the
serving core, and encode.
"""
