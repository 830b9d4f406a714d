"""llama-cpp-python's and OpenAI's shapes: chat templates (rendered in a bounded sandbox), tool calls, the
completion dicts, and create_completion / create_chat_completion over the decode loop."""
