"""The data: Parquet read and checked with pyarrow (``parquet``), the order rows are visited in
(``order``), streaming ingest for data larger than memory (``stream_plan``: what the metadata says
and where each row falls, no Ray; ``stream``: the reader actor and the sources workers take rows
from), local paths and storage URIs (``storage``), batches onto the device (``device_copy``),
language-model data (``tokenizer``: text to ids and back; ``documents``: the text a tokenizing job
reads; ``tokenized``: ids to rows of T+1 tokens), and the ``python -m ray_jobs.data`` command line
(``__main__``; ``cli``: the argument parser every raypar command line uses).

Its code runs in the driver (reading and planning), in the workers and stages (each reads its own
rows) and in the stream's ``WindowReader`` actor. It imports nothing of raypar's above it.
"""
