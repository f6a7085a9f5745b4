"""Developer command-line tools that write local artifacts (tiny models and tokenizers): no hub download, ever."""
