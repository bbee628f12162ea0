"""Tool calls, independent of the front end: the request's tools and tool_choice
(`spec.py`), the JSON schema that forces a call (`spec.py`), the default tools prompt and
tool messages for templates that have no tools section (`prompt.py`), the model's output
turned into calls, whole or streamed (`calls.py`), and one parser per model family's own
call format (`parsers/`)."""
