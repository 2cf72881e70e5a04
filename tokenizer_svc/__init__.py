"""Tokenizer service: chat templates (sandboxed Jinja), tools, image inputs, tokenize,
incremental UTF-8 safe detokenization and stop strings, behind `meshserve.v1.Tokenizer`."""
