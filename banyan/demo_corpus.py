"""Training text for the demo model's tokenizer (see ``banyan.demo``).

Original prose, dialogue, instructions, code, numbers and non-ASCII text (accented Latin, Greek,
Cyrillic, CJK, emoji) so the byte-level BPE learns ordinary English merges while multi-byte
characters still occur and get split across tokens. Editing this text changes the demo model's
version key, so existing caches are rebuilt rather than reused.
"""

from __future__ import annotations

__all__ = ["CORPUS", "corpus_text"]

_STORIES = """\
The lighthouse keeper on Marrow Point had not spoken to another person in eleven days. Each morning
she climbed the ninety-two steps, polished the great lens with a soft cloth, and wrote the weather
into a ledger whose spine had cracked years before she arrived. The wind came from the west most days,
carrying salt and the smell of kelp, and on clear evenings she could see the lights of the mainland
flicker like a row of patient candles. When the supply boat finally rounded the headland, she found
that she had forgotten how to begin a conversation. She waved instead, and the young pilot waved back,
and for a while that was enough.
Tomas grew tomatoes on the roof of a building that was older than the city around it. His neighbours
thought the project was foolish until August, when the vines leaned over the railing heavy with fruit
and he handed out paper bags to anyone who climbed the stairs. He kept a notebook of every variety he
planted: the striped ones, the yellow pears, the dark purple beefsteaks that split after a heavy rain.
Next year, he said, he would try peppers, and perhaps a small lemon tree in a barrel if the landlord
agreed to look the other way.
The river was low that summer, low enough that the children could walk across the stones without
wetting their knees. They built dams of mud and driftwood, named every pool after a famous ocean, and
argued about whether the silver fish darting between the reeds were trout or something more mysterious.
In the evenings their parents called them home across the fields, and the sound of the names drifted
over the water like birdsong, one after another, until the banks were quiet again.
A clockmaker in the old quarter repaired watches for sailors, bakers, and schoolteachers. He said that
every clock told two stories: the time it showed and the time it had lived through. Some arrived
full of sand from distant beaches, others smelled of flour or chalk or machine oil. He cleaned each
gear with a brush no wider than an eyelash and set the hands running again with a small, satisfied
nod, as if greeting an old friend who had finally come back from a long journey.
On the night train to the north, a girl with a violin case shared a compartment with an elderly man
who was reading a book about bridges. Somewhere past midnight the train stopped in a station with no
name, and snow began to fall. Neither of them could sleep, so she played a slow tune very quietly, and
he told her about the stone arch his grandfather had built over a river that no longer existed. By
morning they had exchanged addresses, though both suspected they would never write.
"""

_ESSAYS = """\
Good software is rarely clever. It is patient, predictable, and honest about what it does not know.
A function that checks its inputs and fails with a clear message saves more time than a function that
runs a little faster and fails mysteriously. The best teams treat error messages as part of the user
interface, because for the person reading them at two in the morning, they are.
Learning a new language, whether spoken or programmed, follows a familiar curve. At first every
sentence is a puzzle and every rule feels arbitrary. Then, slowly, patterns begin to repeat, and the
mind stops translating word by word. The learner who keeps going through the frustrating middle, who
reads a little every day and accepts making mistakes in public, almost always arrives somewhere useful.
Cities are conversations between the past and the future. A narrow street laid out for carts now
carries bicycles and delivery vans; a warehouse built for grain becomes a library, a market, or a
theatre. Planners who ignore history build places that feel empty, while those who cling to it too
tightly build museums. The interesting work happens in between, where old walls meet new needs.
Weather forecasting improved not because any single model became perfect but because many imperfect
models were combined, measured against reality, and corrected every day. Each forecast is a small
experiment. When tomorrow arrives, the error is recorded and the next prediction is slightly better.
Progress of this kind is quiet and cumulative, and it rarely makes the news.
Memory is a strange archive. We forget the names of streets we walked a thousand times but remember
the colour of a stranger's umbrella on a rainy afternoon. Psychologists say that emotion and surprise
act like bookmarks, marking certain moments as worth keeping. Perhaps that is why the ordinary days
blur together while a single unexpected kindness can stay bright for decades.
"""

_DIALOGUE = """\
"Are you sure this is the right road?" asked Mira, folding the map for the third time.
"No," said Jonah cheerfully. "But it is a very nice road, and it goes somewhere."
"That's not how directions work."
"It's exactly how directions work. You pick a road, you see where it goes, and then you decide."
Mira laughed despite herself. "Fine. If we end up in the sea, you're swimming back for the car."
User: Can you explain what a hash table is?
Assistant: A hash table stores values under keys. It runs each key through a hash function to pick a
bucket, so looking up a key usually takes constant time, no matter how many items are stored.
User: What happens when two keys land in the same bucket?
Assistant: That is called a collision. Common fixes are chaining, where each bucket holds a small
list, and open addressing, where the table probes for the next free slot.
User: Thanks! What is the capital of Portugal?
Assistant: The capital of Portugal is Lisbon, a hilly city on the Tagus river known for its trams.
"""

_INSTRUCTIONS = """\
To bake a simple loaf of bread, mix 500 grams of flour, 350 millilitres of warm water, 10 grams of
salt and 7 grams of dried yeast. Knead for ten minutes until the dough is smooth and springy, then
cover the bowl and leave it somewhere warm for about an hour. Shape the loaf, let it rise again for
forty minutes, and bake at 220 degrees for 35 to 40 minutes. The bread is ready when it sounds hollow
when tapped underneath. Let it cool before slicing, however tempting the smell may be.
Before a long hike, check the forecast, tell someone your route, and pack more water than you think
you will need. Bring a map even if your phone has one, because batteries fail and signal disappears
in valleys. Wear boots you have already broken in, and turn back if the weather changes quickly.
"""

_NUMBERS = """\
Quarterly report, 2024: revenue 1,284,500 (up 12.5%), costs 903,120, margin 29.7%. Orders shipped:
Q1 4,210; Q2 4,875; Q3 5,302; Q4 6,019. Average delivery time fell from 3.8 days to 2.9 days.
Temperatures this week: Mon 18.2, Tue 21.0, Wed 19.4, Thu 23.6, Fri 25.1, Sat 24.8, Sun 20.3.
The answer is 42. Pi is about 3.14159, e is about 2.71828, and the square root of 2 is 1.41421.
Call 555-0142 before 09:30 or after 17:45. Meeting on 2025-03-14 at 10:00 in room 3B, floor 12.
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 64 100 128 256 512 1000 1024 2048 4096
0x1F 0xFF 0b1010 1e-5 6.02e23 -273.15 +15 100% 3/4 7:1 #1 $19.99 EUR 45,00 [1, 2, 3] (a, b)
"""

_CODE = """\
def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


if __name__ == "__main__":
    for i, x in enumerate(fibonacci(10)):
        print(f"{i}: {x}")

import json
config = {"name": "banyan", "layers": 4, "hidden_size": 256, "enabled": True, "ratio": 0.5}
with open("config.json", "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message.length;
}

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
git commit -m "Fix off-by-one error in parser" && git push origin main
"""

_MULTILINGUAL = """\
Le café était fermé, alors nous avons marché jusqu'à la boulangerie près de l'église. Déjà midi!
El niño comió una manzana mientras su abuela leía el periódico en el jardín. ¿Dónde está la estación?
Über den Wolken scheint die Sonne immer; die Straße war naß, aber wir gingen trotzdem spazieren.
São Paulo, Zürich, Kraków, Reykjavík, Málaga, Åre, Øresund, Ærø, İstanbul, Łódź, Ñuñoa, Česká Lípa.
Naïve façade, résumé, coöperate, jalapeño, crème brûlée, smörgåsbord, déjà vu, piñata, fiancée.
Ελληνικά: καλημέρα, ευχαριστώ πολύ. Русский: привет, как дела? Спасибо, всё хорошо.
你好，世界。今天天气很好，我们去公园散步吧。我喜欢读书和喝茶。
こんにちは、世界。東京は大きな都市です。ありがとうございます。
안녕하세요. 만나서 반갑습니다. 오늘은 좋은 날이에요.
עברית: שלום עולם. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
Symbols: → ← ↑ ↓ ≤ ≥ ≠ ≈ ∞ ∑ √ ± × ÷ ° µ € £ ¥ © ® ™ § ¶ • … — – « » ¿ ¡ “quotes” ‘single’
Emoji: 😀 😂 🥲 😍 🤔 🙌 👍 👋 🎉 🚀 🌍 🌧️ 🔥 ⭐ ❤️ 🐍 🦀 🍕 ☕ 🧪 👩‍💻 👨‍👩‍👧 🏳️‍🌈 🇵🇹 🇯🇵
The party was great 🎉 and the cake was even better 🍰. Ship it 🚀! Coffee first ☕, then code 🐍.
"""

_MORE_PROSE = """\
Dear Ana, thank you for the postcard from the coast. The picture of the harbour is now pinned above my
desk, next to the calendar and a list of things I keep meaning to do. The garden is finally waking up
after the long winter: the first tulips opened on Tuesday, the apple tree is covered in small white
buds, and a family of sparrows has moved into the gap under the roof. I have started walking to work
again, which takes forty minutes but gives me time to think. Write soon and tell me everything.
The museum opened its doors at nine, and by ten the main hall was full of school groups, tourists with
cameras, and a few quiet regulars who came every week to sit in front of the same painting. The guard
in the east gallery knew them all by sight. One of them, an old man in a grey coat, always arrived with
a sandwich wrapped in paper and left exactly one hour later, having eaten nothing at all.
When the power failed across the valley, the village discovered that it still knew how to live without
screens. Someone found a box of candles in the church, the baker kept his wood oven burning through the
night, and the teenagers organised a card tournament in the town hall that lasted until sunrise. When
the lights came back three days later, more than a few people admitted that they were almost sorry.
Bees communicate the location of flowers through a dance. A worker returning to the hive moves in a
figure-eight pattern, and the angle of the straight part tells the others which direction to fly
relative to the sun, while the length of the waggle hints at the distance. Scientists needed decades
to decode the system, and they are still discovering new details about how colonies make decisions.
Mountains make their own weather. Warm air rising along a slope cools as it climbs, and the moisture it
carries condenses into clouds that can appear out of a clear sky within minutes. Experienced climbers
learn to read these signs: a small cap of cloud on the summit, a sudden drop in temperature, a change
in the sound of the wind. Ignoring them is how ordinary afternoons turn into dangerous evenings.
The first computers filled entire rooms and needed teams of engineers to keep them running. Programs
were written on punched cards, and a single mistake could mean waiting a whole day to try again. Today
a phone in a pocket is millions of times faster, yet the basic ideas remain the same: instructions,
memory, input and output, and the patient work of breaking a big problem into smaller steps.
A good cup of tea depends on a few simple things: fresh water, the right temperature, and patience.
Green tea prefers water that has cooled a little after boiling, while black tea likes it hot. Steep
for three to five minutes, remove the leaves, and resist the urge to squeeze the bag, which only adds
bitterness. Some people add milk, some add lemon, and some say that both are crimes against the leaf.
Every language model learns from text, and every tokenizer decides how that text is cut into pieces.
Common words become single tokens, rare words are split into fragments, and unusual characters are
broken down into raw bytes. The result is a vocabulary that can represent anything, even a sentence in
a script the model has never seen, at the cost of using more tokens for unfamiliar text.
The harbour town woke early. Fishing boats returned before dawn, gulls circled above the market, and
the cafes along the quay put out their chairs while the cobblestones were still wet from the night.
By noon the square was crowded with visitors buying dried fish, honey, woollen hats and hand-painted
tiles. By evening the boats were gone again, and only the lamps and the smell of the sea remained.
Chess teaches a kind of humility. However carefully you plan, your opponent sees the same board and
has plans of their own. Beginners attack; experienced players wait, improve their pieces, and let the
position tell them when to strike. The greatest lesson is that a mistake is not the end of the game,
only a new problem to solve, and the player who stays calm usually finds a way back.
In the autumn the forest floor turns gold and red, and the air smells of damp leaves and woodsmoke.
Mushrooms appear overnight after the first heavy rain: some bright orange, some pale as paper, a few
shaped like tiny umbrellas. Foragers go out early with baskets and knives, but the wise ones only pick
what they are certain they know, because the forest does not forgive guesses.
The orchestra tuned for what felt like a long time, a cloud of notes drifting up into the dark hall.
Then the conductor raised her hands, the room went silent, and the first violins began a melody so
soft that the audience leaned forward to hear it. For the next hour nobody coughed, nobody checked a
phone, and when the last chord faded there was a full second of stillness before the applause.
Saving money is less about willpower than about habits. Pay yourself first by moving a fixed amount
into savings on the day your salary arrives. Keep a small emergency fund so that a broken boiler or a
dentist bill does not become a debt. Review subscriptions twice a year, cook at home more often, and
remember that small amounts added every month grow surprisingly large over ten or twenty years.
The robot vacuum had a name, a personality, and, according to the children, a favourite corner of the
kitchen where it liked to rest. It bumped politely into chair legs, sang a little tune when it finished,
and once spent an entire afternoon trapped under the sofa, which the family later described as the most
peaceful afternoon of the year. Nobody had the heart to replace it when the newer model came out.
"""

CORPUS: tuple[str, ...] = (_STORIES, _ESSAYS, _MORE_PROSE, _DIALOGUE, _INSTRUCTIONS, _NUMBERS, _CODE, _MULTILINGUAL)


def corpus_text() -> str:
    """The whole corpus as one string (sections separated by blank lines)."""
    return "\n\n".join(CORPUS)
