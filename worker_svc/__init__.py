"""Worker service (decoder, encoder and embedding roles): the gRPC front (servicer.py, generate_stream.py) over the engine package (engine/)."""
