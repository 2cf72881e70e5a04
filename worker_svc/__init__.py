"""Worker service (decoder, encoder and embedding roles): the gRPC front (decoder_servicer.py, generate_stream.py, embedding_servicer.py, encoder_servicer.py) over the engine package (engine/)."""
