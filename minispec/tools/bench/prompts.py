"""The bench's prompts: the built-in ones, a prompts file (the format run.py reads), or token ids."""

from minispec import chat_prompt
from minispec.api import prompt_tensor
from minispec.cli import read_prompts_file

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(i, i + window):
            total += values[j]
        result.append(total / window)
    return result'''

# Open-ended prompts, and one whose answer repeats much of it: where the model-free `lookup` drafter shines.
OPEN_PROMPTS = [
    "The history of the printing press begins in",
    "Question: Why is the sky blue? Explain it to a ten-year-old.\nAnswer:",
]
CODE_PROMPTS = [
    f"Rewrite this Python function with type hints and a docstring, keeping its logic:\n\n{CODE}\n\nRewritten:\n",
]

ARTICLE = ("The city council voted on Tuesday to extend the night bus service to the northern suburbs. The "
           "extension adds four routes, runs every thirty minutes between midnight and five in the morning, and "
           "will cost the city about two million dollars a year. Supporters said night workers in hospitals, "
           "warehouses and restaurants have no other way home; opponents said the buses would run mostly empty "
           "and asked for a one-year trial instead. The council agreed to review ridership after twelve months.")

COUNT_WORDS = '''def count_words(path):
    counts = {}
    with open(path) as handle:
        for line in handle:
            for word in line.split():
                word = word.lower().strip(".,!?")
                counts[word] = counts.get(word, 0) + 1
    return counts'''

TYPOS = ("Our team has been working on the new relase for three months. The main changes are a faster search, "
         "a cleaner setings page and better suport for older phones. We will ship the update next tuesday, "
         "and the old version will keep working untill the end of the year.")

NOTE = ("Hi Sam, the meeting moved to Thursday at 3 pm in room 204. Bring the budget numbers for the second "
        "quarter and the list of vendors. Tell Maria too. Thanks, Jo")

PEOPLE = ("- Alice Moreau, engineer, Paris\n- Bob Tanaka, designer, Osaka\n- Carla Ruiz, manager, Madrid\n"
          "- Dev Patel, analyst, Leeds")

# Answers that copy parts of their prompt with changes: a guess often fails where two earlier passages
# part ways, which is what lookup's and ngram's trees are for.
PARTIAL_PROMPTS = [
    f"Summarize this article in three sentences, reusing its key phrases exactly:\n\n{ARTICLE}",
    f"Rename `values` to `samples` and `window` to `width` in this function, changing nothing else:\n\n{CODE}",
    f"Fix the spelling mistakes in this paragraph and change nothing else:\n\n{TYPOS}",
    "Add a docstring and a comment on each loop to this function, leaving its code exactly as it is:\n\n"
    + COUNT_WORDS,
    f"Rewrite this note as a polite, formal email, keeping every detail:\n\n{NOTE}",
    f"Turn this list into a Markdown table with the columns Name, Role and City:\n\n{PEOPLE}",
]

DEFAULT_PROMPTS = OPEN_PROMPTS + CODE_PROMPTS
BUILTIN_PROMPTS = {"open": OPEN_PROMPTS, "code": CODE_PROMPTS, "partial": PARTIAL_PROMPTS}


def read_prompts(args):
    """Prompts as given (text or id lists): --prompt-ids, --prompts FILE, or the built-in ones."""
    if args.prompt_ids:
        return args.prompt_ids
    if args.prompts is None:
        return DEFAULT_PROMPTS
    if args.prompts in BUILTIN_PROMPTS:
        return BUILTIN_PROMPTS[args.prompts]
    return read_prompts_file(args.prompts, "--prompts")


def prompt_ids_of(target, prompt, chat=False):
    """Token ids of a prompt; text prompts become the user's turn of a chat when `chat` is set."""
    if isinstance(prompt, str) and target.tokenizer is None:
        raise ValueError(f"{target.name} has no tokenizer files: give prompts as token ids "
                         "(--prompt-ids, or a --prompts JSON file of id lists)")
    if isinstance(prompt, str) and chat:
        prompt = chat_prompt(target.tokenizer, prompt)
    return prompt_tensor(target, prompt)[0].tolist()
