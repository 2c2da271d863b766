"""`llmserve gateway`: one OpenAI-compatible endpoint in front of many servers (ours, vLLM, llama.cpp, hosted
APIs). Speaks HTTP only; imports nothing from the engine."""
