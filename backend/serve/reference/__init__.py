"""The reference engine: a stand-in for SGLang that speaks its wire format over this project's own decoders (torch)."""
