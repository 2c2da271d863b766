"""`llmserve plan`: capacity and cost planning, and a simulator of one replica fitted to bench results."""
