"""Worker service (decoder, encoder and embedding roles): the gRPC front (servicer.py, stream_session.py) over the engine package (engine/)."""
