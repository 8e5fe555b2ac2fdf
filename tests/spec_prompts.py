"""Prompts the speculative decoding tests share: code, a repetition that prompt lookup can copy, a sequence
and prose, so that drafts are sometimes right and sometimes wrong."""

SPEC_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat",
    "1, 2, 3, 4, 5,",
    "Write a short story about a robot who learns to paint. It begins in a small workshop where",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY",
]
