"""Instruction prompts for training draft heads, and fresh chat requests for evaluating them.

Two offline prompt sets of :class:`~experiments.datasets.Prompt` records (one user message each, no
download), written for this repository:

- :func:`load_instruct` (training): 790 prompts from 79 templates (:data:`INSTRUCT_TEMPLATES`) in
  twelve categories (:data:`INSTRUCT_CATEGORIES`): writing, roleplay, reasoning, math, coding,
  extraction, stem, humanities, translation, summarization, qa (questions about a given passage) and
  conversation (a request that quotes an earlier exchange, sent as one user message). Each template is
  filled with 10 items of a pool of hand-written fillers: subjects, personas, coding tasks and code
  snippets, sentences to translate (English to French/Spanish/German and back), 30 short original
  paragraphs (:data:`PASSAGES`, used by summarization, qa and extraction), 10 short documents (receipts,
  e-mails, notices) and earlier-conversation threads. People's names and all numbers (math problems,
  number sequences, ages, hours) are drawn with ``random.Random(seed)``, so the same seed gives the same
  list, and ids ``instruct/<category>/<template index>/<slug>`` do not depend on ``seed``. The list comes
  in round-robin order over the categories (and over the templates within a category), so its first
  ``limit`` prompts are a stratified sample.
- :data:`FRESH_CHAT` / :func:`load_fresh_chat` (evaluation only, never training): 32 everyday chat
  requests written by hand in natural, varied wording (recipes, travel, money, health habits,
  relationships, tech help, homework, gifts, ...). They come from no template and share no six-word
  sequence with :func:`load_instruct` or :func:`experiments.datasets.load_chat`
  (``tests/test_instruct_prompts.py`` checks this).

Every passage, sentence, task and question here was written for this module; none is taken or
paraphrased from Spec-Bench (whose kinds of tasks the categories mirror) or any other benchmark.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from experiments.datasets import Prompt, _user, round_robin

Row = dict[str, Any]


def _rows(fields: str, *rows: str | tuple[Any, ...]) -> tuple[Row, ...]:
    """Pool items as dicts; ``fields`` names the columns (space-separated), the first one is the key."""
    names = fields.split()
    out = []
    for row in rows:
        values = (row,) if isinstance(row, str) else row
        if len(values) != len(names):
            raise ValueError(f"pool row {values!r} does not match the fields {names}")
        out.append(dict(zip(names, values)))
    return tuple(out)


def _slug(text: str, words: int = 6) -> str:
    """The first ``words`` ASCII words of ``text``, lower-cased and joined by dashes."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return "-".join(re.findall(r"[a-z0-9]+", ascii_text.lower())[:words])


# ----------------------------------------------------------------------------------------- passages
#: ``(key, passage, question, claim)``: short original paragraphs (3-5 sentences) with a question they
#: answer and a statement that is true, false or not stated in them.
PASSAGES = _rows(
    "key passage question claim",
    (
        "community-garden",
        "In March 2021, residents of Elm Street turned an empty parking lot into a community garden. "
        "Volunteers built 24 raised beds from recycled timber, and a hardware store donated 60 bags of "
        "soil. By the end of the first summer the garden had produced about 400 kilograms of vegetables, "
        "most of which went to a food bank. A retired teacher, Grace Okafor, now runs monthly workshops.",
        "How many raised beds were built, and from what material?",
        "Most of the vegetables were sold at a farmers market.",
    ),
    (
        "honeybees",
        "A honeybee colony can hold between 20,000 and 60,000 workers in summer, but only one queen. "
        "Workers live for about six weeks in the busy season, while the queen may survive for several "
        "years. Foragers share the location of flowers through a waggle dance whose angle shows the "
        "direction relative to the sun. One worker makes only about a twelfth of a teaspoon of honey.",
        "How do foragers tell other bees where flowers are?",
        "Worker bees usually live for several years.",
    ),
    (
        "suez-canal",
        "The Suez Canal opened in November 1869 after about ten years of construction. It links the "
        "Mediterranean Sea with the Red Sea, so ships travelling between Europe and Asia no longer have "
        "to sail around Africa. The project was led by the French diplomat Ferdinand de Lesseps. Today the "
        "canal is about 193 kilometres long and carries a large share of world trade.",
        "Which two seas does the canal connect?",
        "The canal was built in less than two years.",
    ),
    (
        "sourdough-bakery",
        "When Lina Haddad opened her sourdough bakery in 2018, she baked 80 loaves a day and sold out by "
        "noon. Two years later she hired four bakers and moved into a larger shop on Harbour Road. To "
        "reduce waste, unsold bread is turned into croutons or given to a shelter each evening. The "
        "bakery now sells around 350 loaves on a typical Saturday.",
        "What happens to bread that is not sold by the evening?",
        "The bakery moved to a larger shop on Harbour Road.",
    ),
    (
        "photosynthesis",
        "Plants make their own food through photosynthesis. Using energy from sunlight, they combine "
        "carbon dioxide from the air with water drawn up through their roots to produce glucose. Oxygen "
        "is released as a by-product, which is why forests and algae matter so much for the air we "
        "breathe. The green pigment chlorophyll captures most of the light used in the process.",
        "What is released as a by-product of photosynthesis?",
        "Chlorophyll is a red pigment found in the roots.",
    ),
    (
        "printing-press",
        "Around 1450, Johannes Gutenberg built a printing press with movable metal type in Mainz. Before "
        "that, most books in Europe were copied by hand, which could take months for a single volume. "
        "His best-known work, a Latin Bible, was printed in roughly 180 copies. Within fifty years, "
        "print shops had spread to more than 200 European towns, making books far cheaper.",
        "Roughly how many copies of the Bible did Gutenberg print?",
        "Gutenberg built his press in Paris.",
    ),
    (
        "city-cycling",
        "Last year the city of Ridgeford added 35 kilometres of protected bike lanes. According to the "
        "transport office, daily cycling trips rose from about 12,000 to 19,500 within twelve months. "
        "Shops on Mill Lane reported more customers, although some drivers complained about losing "
        "parking spaces. The council plans to review the scheme in September 2025.",
        "By how much did the number of daily cycling trips grow?",
        "Every shop on Mill Lane reported fewer customers.",
    ),
    (
        "teen-sleep",
        "Sleep researchers recommend that teenagers get eight to ten hours of sleep a night, yet many get "
        "fewer than seven. During puberty the body clock shifts, so teenagers naturally feel sleepy later "
        "in the evening. Early school start times therefore clash with their biology. Some schools that "
        "moved the first lesson from 7:30 to 8:30 saw better attendance.",
        "Why do teenagers tend to feel sleepy later in the evening?",
        "Some schools saw better attendance after starting later.",
    ),
    (
        "hawaiian-islands",
        "The Hawaiian Islands formed as the Pacific Plate moved slowly over a hotspot in the Earth's "
        "mantle. Each island grew from volcanic eruptions and was then carried away to the north-west, so "
        "the oldest islands lie furthest from the hotspot. The Big Island, the youngest, still has active "
        "volcanoes such as Kilauea. The plate moves only about seven centimetres a year.",
        "Why are the oldest islands the furthest from the hotspot?",
        "Kilauea is on the oldest of the islands.",
    ),
    (
        "coffee-chain",
        "Brightcup, a small coffee chain founded in Porto in 2012, now runs 14 cafés in three countries. "
        "In 2023 its revenue reached 9.6 million euros, up 18 percent on the year before. The company "
        "pays farmers in Ethiopia and Colombia a fixed price above the market rate. Its chief executive, "
        "Marta Vieira, wants to open a roastery that can supply all the cafés.",
        "In which countries are Brightcup's farmers?",
        "Brightcup already operates its own roastery.",
    ),
    (
        "apollo-11",
        "On 20 July 1969, the Apollo 11 lunar module landed in the Moon's Sea of Tranquillity. Neil "
        "Armstrong and Buzz Aldrin spent about two and a half hours walking on the surface, while Michael "
        "Collins stayed in orbit in the command module. The crew collected around 21.5 kilograms of rock "
        "and soil and splashed down in the Pacific Ocean on 24 July.",
        "Who stayed in orbit while the others walked on the Moon?",
        "The crew splashed down in the Atlantic Ocean.",
    ),
    (
        "library-renovation",
        "The public library in Westbrook reopened on 3 February after an eight-month renovation that cost "
        "2.4 million dollars. It now has a makerspace with two 3D printers, a quiet study floor and a "
        "children's room painted by the local artist Tomás Reyes. Opening hours run until 9 p.m. on "
        "weekdays. In the first week, more than 1,500 new library cards were issued.",
        "How long did the renovation take?",
        "The library now closes at 6 p.m. on weekdays.",
    ),
    (
        "water-cycle",
        "Water on Earth moves in a continuous cycle. Heat from the sun evaporates water from oceans, lakes "
        "and rivers, and plants release more through their leaves. As the vapour rises and cools, it "
        "condenses into tiny droplets that form clouds. When the droplets grow heavy enough they fall as "
        "rain or snow, and the water flows back to the sea or soaks into the ground.",
        "What happens to water vapour as it rises and cools?",
        "Plants release water through their leaves.",
    ),
    (
        "silk-road",
        "The Silk Road was not a single road but a network of trade routes linking China with Central "
        "Asia, the Middle East and Europe. It flourished especially under the Han and Tang dynasties. "
        "Merchants carried silk, spices, paper and metals, but ideas, religions and diseases moved along "
        "the same routes. Few traders made the whole journey; goods passed through many hands.",
        "Besides goods, what else spread along these routes?",
        "Most merchants travelled all the way from China to Europe.",
    ),
    (
        "hybrid-work",
        "A survey of 2,000 office workers carried out in May 2024 found that 58 percent preferred a hybrid "
        "schedule, working from home two or three days a week. Only 11 percent wanted to return to the "
        "office full time. Managers were more cautious: 40 percent said meeting in person led to better "
        "teamwork. The authors, from the consultancy Northline, recommend clear rules for office days.",
        "What share of the workers wanted to be in the office full time?",
        "Most managers wanted their staff to work fully remotely.",
    ),
    (
        "octopus",
        "Octopuses have three hearts and blue, copper-based blood. Two hearts pump blood through the "
        "gills, while the third sends it around the rest of the body. About two thirds of an octopus's "
        "neurons sit in its arms rather than its brain, which lets each arm react to touch and taste on "
        "its own. Many species live for only one or two years.",
        "What is the job of the third heart?",
        "Octopus blood is red because it is rich in iron.",
    ),
    (
        "first-marathon",
        "Daniel Park decided to run his first marathon at the age of 45. He followed a 16-week plan, "
        "running four times a week and adding about two kilometres to his long run every fortnight. A "
        "calf injury in week nine forced him to rest for ten days. He finished the Lakeside Marathon in "
        "October in 4 hours and 12 minutes, twelve minutes slower than his goal.",
        "What was Daniel's target time?",
        "Daniel never had to pause his training because of an injury.",
    ),
    (
        "penicillin",
        "In September 1928, Alexander Fleming came back from holiday to his London laboratory and noticed "
        "that mould had contaminated a dish of bacteria. Around the mould, the bacteria had died. He "
        "named the active substance penicillin, but it was hard to produce in quantity. In the early "
        "1940s Howard Florey and Ernst Chain found ways to purify it, in time for use in the war.",
        "Who found ways to purify penicillin?",
        "Fleming made his discovery while working in Paris.",
    ),
    (
        "plastic-recycling",
        "Only a small share of the plastic made worldwide is ever recycled; estimates often put it below "
        "10 percent. One problem is that there are many kinds of plastic, marked with codes from 1 to 7, "
        "and they cannot simply be melted down together. Bottles made of PET, code 1, are among the "
        "easiest to recycle. Food left in containers can spoil a whole batch at the sorting plant.",
        "Which kind of plastic is among the easiest to recycle?",
        "All kinds of plastic can easily be melted down together.",
    ),
    (
        "school-trip",
        "On Thursday 14 March, the 32 pupils of class 6B will visit the Natural History Museum. The coach "
        "leaves the school gate at 8:15 and returns at about 4:30. Each pupil should bring a packed lunch, "
        "a notebook and up to 5 pounds for the gift shop. Parents with questions can contact Mr Adebayo, "
        "the class teacher, before Tuesday.",
        "At what time does the coach come back?",
        "Pupils have to buy their lunch at the museum.",
    ),
    (
        "northern-lights",
        "The northern lights appear when charged particles from the Sun collide with gases high in "
        "Earth's atmosphere. Oxygen usually glows green, while nitrogen can add blue or purple tones. The "
        "lights are most common in a ring around the magnetic poles, which is why northern Norway and "
        "Canada see them often. Displays are strongest around the peak of the Sun's 11-year cycle.",
        "Which gas usually produces the green colour?",
        "The lights are caused by moonlight reflecting off polar ice.",
    ),
    (
        "tea-history",
        "Tea drinking began in China, where it was used as a medicine long before it became an everyday "
        "drink. Portuguese and Dutch traders brought tea to Europe in the early 1600s. In Britain it became "
        "fashionable after 1662, when Catherine of Braganza, the Portuguese wife of King Charles II, made "
        "it popular at court. By the 1800s it was cheap enough for working families.",
        "Who made tea fashionable at the British court?",
        "Tea first reached Europe in the 1400s.",
    ),
    (
        "meal-planning-app",
        "Two university friends, Ana Costa and Felix Braun, launched a meal-planning app called Pantry in "
        "January 2022. The app suggests recipes based on what is already in the user's fridge. After a "
        "slow start, downloads jumped to 250,000 when a cooking blogger recommended it. The founders "
        "raised 1.2 million dollars from investors in 2023 and hired six developers.",
        "What made the number of downloads jump?",
        "Pantry was launched in 2020.",
    ),
    (
        "glaciers",
        "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is "
        "pressed into dense ice, which slowly flows downhill under its own weight. As glaciers move, they "
        "carve valleys and carry rocks that may be left hundreds of kilometres away. Since the middle of "
        "the nineteenth century, most glaciers in the Alps have lost much of their volume.",
        "How does snow turn into glacier ice?",
        "Glaciers can carry rocks far from where they started.",
    ),
    (
        "railway-time",
        "Before railways, each British town kept its own local time based on the sun, so Bristol was "
        "about ten minutes behind London. This caused confusion once trains ran to fixed timetables. In "
        "1840 the Great Western Railway adopted London time at all its stations, and other companies "
        "soon followed. Greenwich Mean Time became the legal time across Great Britain in 1880.",
        "Why did local times cause trouble for the railways?",
        "Bristol's local time was ahead of London's.",
    ),
    (
        "home-energy",
        "After their electricity bill rose to 210 euros a month, the Novak family decided to cut their "
        "energy use. They replaced 18 old light bulbs with LEDs, turned the heating down by two degrees "
        "and began drying laundry outside. Within six months their bill had fallen to about 150 euros. "
        "Their daughter Petra tracked the savings in a spreadsheet for a school project.",
        "By how much did the family's monthly bill fall?",
        "The family installed solar panels on the roof.",
    ),
    (
        "sharks",
        "Sharks have existed for more than 400 million years, longer than trees. Unlike bony fish, their "
        "skeletons are made of cartilage, the flexible material found in human ears. Many sharks must keep "
        "swimming so that water flows over their gills, although some species can rest on the sea floor. "
        "They can sense the tiny electric fields produced by the muscles of their prey.",
        "What are shark skeletons made of?",
        "Every kind of shark has to keep swimming all the time.",
    ),
    (
        "florence-renaissance",
        "In the fifteenth century, Florence became a centre of the Renaissance, a revival of interest in "
        "the art and learning of ancient Greece and Rome. Wealthy families, above all the Medici, paid "
        "artists and architects to create new works. Filippo Brunelleschi completed the great dome of the "
        "city's cathedral in 1436, a feat of engineering that had puzzled builders for decades.",
        "Which family is named as a major patron of the arts?",
        "The cathedral's dome was completed in 1536.",
    ),
    (
        "dairy-cooperative",
        "In 2019, forty dairy farmers in the Vale district formed a cooperative to sell cheese directly "
        "to shops instead of through a large wholesaler. By sharing one processing plant and a delivery "
        "van, they cut their costs by about a quarter. The cooperative's aged cheddar won a regional prize "
        "in 2022. Members meet every three months to vote on prices and new products.",
        "How did the farmers reduce their costs?",
        "The cooperative was founded by four farmers.",
    ),
    (
        "language-practice",
        "Studies of language learning suggest that short daily practice works better than long, irregular "
        "sessions. Reviewing new words after one day, then three days, then a week helps move them into "
        "long-term memory, a method called spaced repetition. Speaking with others, even with mistakes, "
        "builds confidence faster than reading alone.",
        "What is spaced repetition?",
        "Reading alone builds confidence faster than speaking.",
    ),
)

#: ``(key, doctype, fields, document)``: short everyday documents for extraction.
DOCUMENTS = _rows(
    "key doctype fields doc",
    (
        "meeting-email",
        "e-mail",
        "the meeting date, time, room, deadline and contact person",
        "Hi team, the quarterly review moves from Monday 9 June to Wednesday 11 June at 14:00 in Room 4B. "
        "Please send your slides to Priyanka by Tuesday noon. Dial-in code: 552 318. Thanks, Joel",
    ),
    (
        "grocery-receipt",
        "receipt",
        "the shop name, the date, each item with its quantity and price, and the total",
        "GREEN LEAF GROCERS  12/05/2024 10:42\n2 x Oat milk 1L  3.80\n1 x Sourdough loaf  4.20\n"
        "3 x Lemons  1.50\nSubtotal 9.50  Discount -0.50  TOTAL 9.00\nPaid by card ending 4471",
    ),
    (
        "barista-job-ad",
        "job advert",
        "the job title, employer, address, hours, pay, deadline and contact",
        "Part-time barista wanted at Cornerstone Café, 18 Quay Street. 20 hours a week, weekends included, "
        "13.50 per hour plus tips. Experience with espresso machines preferred. Apply by 30 April to "
        "jobs@cornerstone.example.",
    ),
    (
        "book-swap-notice",
        "notice",
        "the event name, date, times, venue, rules, price and organiser",
        "Spring Book Swap! Saturday 6 April, 10 a.m. to 1 p.m., St Mary's Hall. Bring up to five books "
        "and take home the same number. Tea and cake 2 pounds, all proceeds to the children's ward. "
        "Organised by the Riverside Reading Circle.",
    ),
    (
        "flat-listing",
        "flat listing",
        "the size, rooms, rent, extra costs, date available, pet policy and contact",
        "Bright two-bedroom flat on the third floor, 68 square metres, south-facing balcony. Rent 1,150 "
        "euros per month plus 180 euros service charges. Available from 1 September. Pets allowed on "
        "request. Viewings: call Mrs Lindqvist on 0176 555 0192.",
    ),
    (
        "dentist-reminder",
        "appointment reminder",
        "the dentist, date, time, what to bring and the cancellation rule",
        "Reminder: your check-up with Dr Sana Mirza is on Friday 22 November at 9:40. Please arrive ten "
        "minutes early and bring your insurance card. To cancel, call 020 7946 0311 at least 24 hours "
        "before the appointment.",
    ),
    (
        "flight-booking",
        "booking confirmation",
        "the booking reference, passenger, flight number, route, date, times, seat and baggage",
        "Booking ref QX7T2M. Passenger: Ms Helena Ortiz. Flight NV 482 from Lisbon (LIS) to Copenhagen "
        "(CPH), 3 August, departs 06:55, arrives 11:20. Seat 14C. Baggage: 1 x 23 kg checked bag.",
    ),
    (
        "backpack-review",
        "product review",
        "the product name, price, rating, and what the reviewer liked and disliked",
        "I bought the Trailmaster 40 backpack in March for a week in the Dolomites. It held everything I "
        "needed and the hip belt made 8-hour hikes comfortable. The rain cover leaked on day three, "
        "though. For 89 euros it is good value: 4 stars.",
    ),
    (
        "pancake-recipe",
        "recipe card",
        "the number of servings, every ingredient with its amount, and all times",
        "Grandma's pancakes (makes 12): 250 g flour, 2 eggs, 400 ml milk, a pinch of salt, 1 tbsp melted "
        "butter. Rest the batter for 20 minutes. Cook on a medium heat for about 1 minute per side.",
    ),
    (
        "chess-club-minutes",
        "set of meeting minutes",
        "the date, attendees, decisions, action items and the next meeting date",
        "Chess club meeting, 2 October. Present: Ivo, Martina, Jae-won, Sunil. Agreed: the membership fee "
        "stays at 30 per year; the tournament moves to 16 November; Martina will order four new clocks. "
        "Next meeting: 6 November.",
    ),
)

# ------------------------------------------------------------------------------------------- pools
_STORY_SUBJECTS = _rows(
    "subject",
    "a lighthouse keeper who finds a letter addressed to her from fifty years ago",
    "a robot vacuum cleaner that escapes from an apartment",
    "two strangers stuck in a lift during a power cut",
    "a village where it has not rained for a whole year",
    "a boy who can understand what pigeons say",
    "the last customer on the night a bookshop closes for good",
    "a grandmother teaching her grandson to fish",
    "a lost suitcase that keeps turning up at the wrong airports",
    "an astronaut coming home after a year in orbit",
    "a street musician whose song becomes famous overnight",
    "a girl who plants a tree for every year of her life",
    "a ferry crossing on a foggy morning",
    "a chef who has lost her sense of taste",
    "a dog that waits every evening at a small train station",
    "an old map found inside a library book",
    "a town that throws a festival for its oldest bridge",
    "a retired clockmaker and a broken cuckoo clock",
    "a snowstorm that grounds every flight on New Year's Eve",
    "a teenager running a bike-repair stand on a street corner",
    "a whale seen from a small fishing boat",
)
_PRODUCTS = _rows(
    "product",
    "a foldable bamboo laptop stand",
    "a set of reusable beeswax food wraps",
    "a solar-powered camping lantern",
    "a ceramic pour-over coffee dripper",
    "noise-reducing earbuds designed for sleeping",
    "a cast-iron frying pan with a wooden handle",
    "a waterproof 30-litre hiking backpack",
    "a smart plant pot that reminds you to water",
    "a set of wool dryer balls",
    "a magnetic building kit for young children",
)
_OCCASIONS = _rows(
    "occasion",
    "my best friend's wedding",
    "my grandfather's 90th birthday",
    "a colleague's retirement after 35 years at the company",
    "the opening of a neighbourhood library",
    "my sister's graduation dinner",
    "the end-of-season party of a youth football team",
    "a farewell party for a teacher moving abroad",
    "my parents' 40th wedding anniversary",
    "the launch of a small family business",
    "a welcome dinner for new exchange students",
)
_OPINIONS = _rows(
    "opinion",
    "schools should teach cooking as a required subject",
    "cities should make public transport free",
    "every teenager should have a part-time job",
    "phones should be banned during family meals",
    "workplaces should move to a four-day week",
    "homework should be optional in primary school",
    "people should repair things instead of replacing them",
    "museums should be free to enter",
    "everyone should learn basic first aid",
    "towns should plant fruit trees in public parks",
)
_LETTERS = _rows(
    "issue recipient",
    ("a heating system that has been broken for two weeks", "my landlord"),
    ("a dangerous pothole on Birch Avenue", "the local council"),
    ("a parcel that arrived damaged", "an online shop"),
    ("the amount of weekend homework", "my child's school"),
    ("cancelling a membership after moving house", "a gym"),
    ("a suitcase that never arrived", "an airline"),
    ("repeated internet outages in the evenings", "my internet provider"),
    ("plans to close the town swimming pool", "the editor of the local newspaper"),
    ("being charged twice for one meal", "a restaurant"),
    ("loud music late at night", "my neighbour"),
)
_PERSONAS = _rows(
    "persona",
    "a ship's cook on a nineteenth-century whaling ship",
    "a museum guard who has worked night shifts for thirty years",
    "a medieval blacksmith",
    "a lighthouse keeper on a remote island",
    "a park ranger in a national forest",
    "a baker in Paris in the 1920s",
    "a detective in a small seaside town",
    "an astronaut on a space station",
    "a beekeeper with fifty hives",
    "a conductor on an overnight sleeper train",
    "a wise old tortoise living in a city park",
    "a librarian in a castle library",
    "a barista at a busy airport café",
    "a mountain guide in the Himalayas",
    "a circus acrobat before the last show of the season",
    "a volcanologist camping near an active crater",
    "a tailor who makes costumes for a theatre",
    "a pirate captain who is secretly afraid of the sea",
    "a robot butler in the year 2150",
    "a farmer bringing in the first harvest after a drought",
)
_SUPPORT = _rows(
    "company complaint",
    ("a bike-sharing service", "The bike I rented had a flat tyre and I was still charged for the hour."),
    ("an online bookshop", "I ordered a hardback but received the paperback edition."),
    ("a streaming service", "My subscription renewed even though I cancelled it last week."),
    ("a food delivery app", "My order arrived forty minutes late and the soup was cold."),
    ("a seaside hotel", "I booked a sea view, but my window faces the car park."),
    ("a mobile phone company", "I was charged for roaming although I never left the country."),
    ("a furniture store", "Two screws are missing from the wardrobe I bought."),
    ("a language-learning app", "I lost my 200-day streak because the app crashed."),
    ("a gym chain", "The showers at my branch have been cold for a week."),
    ("a train company", "My train was cancelled and I missed my connection to the airport."),
)
_CITIES = _rows(
    "city",
    "Lisbon",
    "Kyoto",
    "Edinburgh",
    "Mexico City",
    "Prague",
    "Cape Town",
    "Montreal",
    "Istanbul",
    "Melbourne",
    "Buenos Aires",
)
_JOBS = _rows(
    "job",
    "a junior web developer",
    "a zookeeper",
    "a hotel receptionist",
    "a primary school teacher",
    "a data analyst",
    "a flight attendant",
    "a sous-chef",
    "a bicycle mechanic",
    "a newspaper reporter",
    "a nurse on a children's ward",
)
_EVENTS = _rows(
    "event",
    "cross-country race",
    "swimming gala",
    "kayak race",
    "sack race at the school fair",
    "cooking competition",
    "spelling bee",
    "chess tournament",
    "quiz show",
    "rowing regatta",
    "go-kart race",
)
_CORRELATIONS = _rows(
    "observation conclusion",
    ("Cities with more libraries have higher average incomes.", "building libraries makes people richer"),
    ("Students who eat breakfast get better grades.", "breakfast is what improves grades"),
    ("Ice-cream sales and sunburn cases rise in the same weeks.", "ice cream causes sunburn"),
    ("People who own dogs report less stress.", "getting a dog will lower anyone's stress"),
    ("Hospitals with more doctors record more deaths.", "doctors make patients less safe"),
    ("Children with bigger shoe sizes read better.", "big feet help children read"),
    ("Towns with more fire stations have more fires.", "fire stations cause fires"),
    ("Runners in expensive shoes finish marathons faster.", "expensive shoes make people run faster"),
    ("Companies that hold more meetings earn lower profits.", "meetings destroy profits"),
    ("Countries that eat more chocolate win more Nobel prizes.", "chocolate makes people smarter"),
)
_RELATIONS = _rows(
    "relation",
    "cousin",
    "younger brother",
    "younger sister",
    "nephew",
    "niece",
    "student",
    "neighbour's daughter",
    "godson",
    "goddaughter",
    "teammate",
)
_FERMI = _rows(
    "question",
    "how many litres of water a family of four uses in a year",
    "how many words a person speaks in an average day",
    "how many bicycles there are in a city of one million people",
    "how many tennis balls would fit inside a city bus",
    "how many loaves of bread a town of 20,000 people eats in a week",
    "how many steps it would take to walk from Paris to Rome",
    "how many hours of video a person watches in a lifetime",
    "how many pizzas are delivered in a large city on a Friday night",
    "how many times a human heart beats in a year",
    "how many books would fit in an ordinary living room",
)
_DILEMMAS = _rows(
    "option other",
    ("renting a flat in the city centre", "buying a house in the suburbs"),
    ("taking a well-paid job far from my family", "staying in a lower-paid job near home"),
    ("repairing my ten-year-old car", "buying a second-hand electric car"),
    ("studying abroad for a year", "starting work straight after graduating"),
    ("buying a laptop now", "waiting six months for the next model"),
    ("adopting a puppy", "adopting an older dog"),
    ("a six-hour train journey", "a one-hour flight plus the time at the airport"),
    ("a gym membership", "running outdoors for free"),
    ("hiring a freelancer", "training an existing employee"),
    ("a fixed-rate mortgage", "a variable-rate mortgage"),
)


def _seq_step(rng: random.Random) -> list[int]:
    s, d = rng.randint(2, 20), rng.randint(3, 11)
    return [s + i * d for i in range(5)]


def _seq_double(rng: random.Random) -> list[int]:
    s = rng.randint(1, 7)
    return [s * 2**i for i in range(6)]


def _seq_triple(rng: random.Random) -> list[int]:
    s = rng.randint(1, 4)
    return [s * 3**i for i in range(5)]


def _seq_squares(rng: random.Random) -> list[int]:
    o = rng.randint(1, 6)
    return [(i + o) ** 2 for i in range(5)]


def _seq_squares_plus(rng: random.Random) -> list[int]:
    c = rng.randint(1, 9)
    return [i * i + c for i in range(1, 6)]


def _seq_alternating(rng: random.Random) -> list[int]:
    x, up, down = rng.randint(1, 10), rng.randint(4, 9), rng.randint(1, 3)
    out = [x]
    for i in range(5):
        x += up if i % 2 == 0 else -down
        out.append(x)
    return out


def _seq_fibonacci(rng: random.Random) -> list[int]:
    out = [rng.randint(1, 5), rng.randint(2, 7)]
    while len(out) < 7:
        out.append(out[-1] + out[-2])
    return out


def _seq_growing(rng: random.Random) -> list[int]:
    x, d = rng.randint(1, 10), rng.randint(1, 4)
    out = [x]
    for i in range(5):
        x += d + i
        out.append(x)
    return out


def _seq_double_plus_one(rng: random.Random) -> list[int]:
    out = [rng.randint(1, 5)]
    while len(out) < 5:
        out.append(2 * out[-1] + 1)
    return out


def _seq_countdown(rng: random.Random) -> list[int]:
    s, d = rng.randint(80, 120), rng.randint(4, 9)
    return [s - i * d for i in range(5)]


def _seq(fn: Callable[[random.Random], list[int]]) -> Callable[[random.Random], str]:
    return lambda rng: ", ".join(map(str, fn(rng)))


_SEQUENCES = _rows(
    "rule seq",
    ("constant-step", _seq(_seq_step)),
    ("doubling", _seq(_seq_double)),
    ("tripling", _seq(_seq_triple)),
    ("squares", _seq(_seq_squares)),
    ("squares-plus", _seq(_seq_squares_plus)),
    ("alternating", _seq(_seq_alternating)),
    ("fibonacci-like", _seq(_seq_fibonacci)),
    ("growing-steps", _seq(_seq_growing)),
    ("double-plus-one", _seq(_seq_double_plus_one)),
    ("countdown", _seq(_seq_countdown)),
)
_ITEMS = _rows(
    "item",
    "notebooks",
    "pencils",
    "mugs",
    "T-shirts",
    "balloons",
    "candles",
    "pairs of socks",
    "beads",
    "postcards",
    "keyrings",
    "scarves",
    "flower pots",
    "water bottles",
    "umbrellas",
    "stickers",
    "bookmarks",
    "tennis balls",
    "crayons",
    "plates",
    "paper lanterns",
)
_PLACES = _rows(
    "place",
    "vegetable garden",
    "swimming pool",
    "playground",
    "lawn",
    "car park",
    "patio",
    "school courtyard",
    "flower bed",
    "fish pond",
    "football pitch",
)
_PY_TASKS = _rows(
    "task",
    "returns the second-largest distinct value in a list of numbers",
    "checks whether a string is a palindrome, ignoring spaces, punctuation and case",
    "counts how often each word appears in a text and returns the five most common",
    "merges two sorted lists into one sorted list without calling sort()",
    "turns a number of seconds into a string such as '2h 05m 09s'",
    "groups a list of e-mail addresses by their domain",
    "returns the running average of a list of numbers",
    "removes duplicates from a list while keeping the original order",
    "checks that a password has at least 10 characters, a digit and an uppercase letter",
    "flattens a nested list of any depth",
    "finds the longest common prefix of a list of strings",
    "rotates a square matrix, given as a list of lists, by 90 degrees clockwise",
    "converts a Roman numeral such as 'XLII' into an integer",
    "splits a list into chunks of a given size",
    "returns the dates of all Mondays in a given month and year",
    "computes the edit distance between two words",
    "parses a string like 'a=1; b=2' into a dictionary",
    "checks whether two strings are anagrams of each other",
    "returns the n-th Fibonacci number using a loop",
    "converts a list of Celsius temperatures to Fahrenheit, rounded to one decimal",
    "finds all pairs of numbers in a list that add up to a target",
    "capitalises the first letter of every sentence in a paragraph",
    "counts the working days between two dates",
    "compresses a string like 'aaabbc' into 'a3b2c1'",
)
_SQL = _rows(
    "task schema",
    ("returns the total revenue per month in 2024", "orders(id, customer_id, total, created_at)"),
    ("finds the highest-paid employee in each department", "employees(id, name, department, salary)"),
    (
        "lists authors with more than three books, sorted by how many they wrote",
        "books(id, title, author, year, copies)",
    ),
    (
        "shows each student's average score, including students without grades",
        "students(id, name) and grades(student_id, course, score)",
    ),
    ("counts the distinct users per page over the last 7 days", "visits(user_id, page, visited_at)"),
    (
        "returns products with fewer than 5 in stock and the cost of restocking each to 20",
        "products(id, name, price, stock)",
    ),
    (
        "finds tomorrow's flights from Oslo that still have free seats",
        "flights(id, origin, destination, departs_at, seats_free)",
    ),
    ("computes the average rental time in minutes per bike", "rentals(id, bike_id, start_time, end_time)"),
    (
        "lists the three cities with the highest total order value",
        "customers(id, name, city) and orders(id, customer_id, total)",
    ),
    (
        "returns the ten most-liked posts with their like counts",
        "posts(id, author, created_at) and likes(post_id, user_id)",
    ),
)
_SNIPPETS = _rows(
    "key code",
    ("word-lengths", "def f(words):\n    return {w: len(w) for w in words if w.isalpha()}"),
    ("even-positions", "total = 0\nfor i, x in enumerate(values):\n    if i % 2 == 0:\n        total += x"),
    (
        "squeeze-repeats",
        "def g(s):\n    out = []\n    for ch in s:\n        if not out or out[-1] != ch:\n"
        "            out.append(ch)\n    return ''.join(out)",
    ),
    (
        "most-common",
        "from collections import Counter\n\ndef h(items):\n    c = Counter(items)\n"
        "    top = max(c.values())\n    return [k for k, v in c.items() if v == top]",
    ),
    ("chunks", "def chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]"),
    (
        "sort-people",
        "data = sorted(people, key=lambda p: (p['age'], p['name']))\n"
        "youngest = data[0]['name'] if data else None",
    ),
    ("leap-year", "def is_leap(y):\n    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)"),
    (
        "error-lines",
        "with open('log.txt') as fh:\n    errors = [line for line in fh if 'ERROR' in line]\n"
        "print(len(errors))",
    ),
    (
        "dict-depth",
        "def depth(d):\n    if not isinstance(d, dict) or not d:\n        return 0\n"
        "    return 1 + max(depth(v) for v in d.values())",
    ),
    (
        "map-filter",
        "nums = [3, 8, 1, 9]\nsquares = list(map(lambda n: n * n, filter(lambda n: n > 2, nums)))",
    ),
)
_BUGGY = _rows(
    "key code",
    (
        "average",
        "def average(xs):\n    total = 0\n    for x in xs:\n        total = x\n    return total / len(xs)",
    ),
    ("last-n", "def last_n(items, n):\n    return items[-n:]"),
    ("mutable-default", "def add_item(item, basket=[]):\n    basket.append(item)\n    return basket"),
    ("count-down", "def count_down(n):\n    while n > 0:\n        print(n)\n    print('Lift off!')"),
    (
        "find-index",
        "def find_index(xs, target):\n    for i in range(1, len(xs)):\n        if xs[i] == target:\n"
        "            return i\n    return -1",
    ),
    ("is-even", "def is_even(n):\n    if n % 2 == 1:\n        return True\n    return False"),
    (
        "max-value",
        "def max_value(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n"
        "    return best",
    ),
    ("fahrenheit", "def to_fahrenheit(c):\n    return c * 5 / 9 + 32"),
    (
        "remove-negatives",
        "def remove_negatives(xs):\n    for x in xs:\n        if x < 0:\n            xs.remove(x)\n"
        "    return xs",
    ),
    (
        "greet",
        "def greet(names):\n    for name in names:\n        message = 'Hello, ' + name\n    return message",
    ),
)
_CONCEPTS = _rows(
    "concept",
    "entropy",
    "the Doppler effect",
    "natural selection",
    "compound interest",
    "plate tectonics",
    "the greenhouse effect",
    "DNA replication",
    "series and parallel circuits",
    "buoyancy",
    "the speed of sound",
    "chemical equilibrium",
    "inertia",
    "how the immune system fights a cold",
    "the law of large numbers",
    "friction",
    "how lenses focus light",
    "the pH scale",
    "machine learning",
    "binary numbers",
    "static electricity",
)
_PAIRS = _rows(
    "x y",
    ("weather", "climate"),
    ("speed", "velocity"),
    ("mitosis", "meiosis"),
    ("an atom", "a molecule"),
    ("a virus", "a bacterium"),
    ("mass", "weight"),
    ("alternating current", "direct current"),
    ("RAM", "disk storage"),
    ("a comet", "an asteroid"),
    ("an element", "a compound"),
)
_PROCESSES = _rows(
    "process",
    "a refrigerator keeps food cold",
    "a GPS receiver works out where it is",
    "the kidneys filter blood",
    "a solar panel turns light into electricity",
    "an aeroplane wing produces lift",
    "bread dough rises",
    "a microwave oven heats food",
    "a phone's touchscreen detects a finger",
    "the heart pumps blood around the body",
    "a rainbow forms after a shower",
)
_PHENOMENA = _rows(
    "phenomenon",
    "does ice float on water",
    "do we have seasons",
    "does a spoon look bent in a glass of water",
    "do onions make people cry",
    "do cats' eyes shine in the dark",
    "does metal feel colder than wood at the same temperature",
    "do leaves change colour in autumn",
    "do you hear a rushing sound when you hold a shell to your ear",
    "does bread go stale",
    "do planes leave white trails in the sky",
)
_HISTORY = _rows(
    "event",
    "the fall of the Western Roman Empire",
    "the French Revolution",
    "the Industrial Revolution in Britain",
    "the Black Death in Europe",
    "the abolition of slavery in the British Empire",
    "the end of the Cold War",
    "the Meiji Restoration in Japan",
    "the Protestant Reformation",
    "the beginning of farming in the Neolithic period",
    "the rise of the Mongol Empire",
)
_THINKERS = _rows(
    "thinker",
    "Confucius",
    "Socrates",
    "Aristotle",
    "Mary Wollstonecraft",
    "John Stuart Mill",
    "Simone de Beauvoir",
    "Immanuel Kant",
    "Ibn Khaldun",
    "Hannah Arendt",
    "Adam Smith",
)
_INVENTIONS = _rows(
    "invention",
    "the mechanical clock",
    "the bicycle",
    "the telephone",
    "refrigeration",
    "the washing machine",
    "photography",
    "the railway",
    "radio",
    "the magnetic compass",
    "paper money",
)
_MOVEMENTS = _rows(
    "m1 m2",
    ("Impressionism", "Expressionism"),
    ("Gothic architecture", "Baroque architecture"),
    ("Romanticism", "Realism"),
    ("Cubism", "Surrealism"),
    ("the haiku", "the sonnet"),
    ("jazz", "the blues"),
    ("Greek tragedy", "Greek comedy"),
    ("Art Nouveau", "Art Deco"),
    ("minimalist music", "Baroque music"),
    ("epic poetry", "the modern novel"),
)
_ETHICS = _rows(
    "question",
    "Should zoos exist?",
    "Is it ever right to break a promise?",
    "Should voting be compulsory?",
    "Do we have a duty to help strangers in need?",
    "Is it fair to judge historical figures by today's values?",
    "Should museums return objects taken during colonial times?",
    "Is lying to protect someone's feelings acceptable?",
    "Should children be paid for doing chores?",
    "Does art have to be beautiful to be valuable?",
    "Should public figures have a right to privacy?",
)
_TERMS = _rows(
    "term field",
    ("opportunity cost", "economics"),
    ("confirmation bias", "psychology"),
    ("the tragedy of the commons", "economics"),
    ("the separation of powers", "political science"),
    ("cultural relativism", "anthropology"),
    ("supply and demand", "economics"),
    ("the placebo effect", "psychology"),
    ("social mobility", "sociology"),
    ("inflation", "economics"),
    ("the social contract", "political philosophy"),
)
_ENGLISH = _rows(
    "sentence",
    "The train to the airport leaves every twenty minutes.",
    "Could you tell me where the nearest pharmacy is?",
    "My sister has been learning the cello for three years.",
    "We forgot the umbrella, so we got soaked on the way home.",
    "The museum is closed on Mondays but open late on Thursdays.",
    "I would like a table for four near the window, please.",
    "Our neighbours planted an apple tree in their front garden.",
    "Please remember to switch off the lights when you leave the office.",
    "The soup needs more salt and a little pepper.",
    "He missed the bus because his alarm clock didn't ring.",
    "Last summer we rented a small house by the lake.",
    "This jacket is too big for me; do you have it in a smaller size?",
    "The children are building a snowman in the park.",
    "I have an appointment with the dentist tomorrow at ten.",
    "The library will lend you up to six books at a time.",
    "She prefers tea in the morning and coffee after lunch.",
    "The meeting has been moved to Wednesday afternoon.",
    "Can we pay by card, or do you only take cash?",
    "The bakery on the corner sells the best croissants in town.",
    "It's going to rain all weekend, so let's watch a film at home.",
    "My grandfather repairs old clocks in his spare time.",
    "Turn left at the second traffic light and the hotel is on your right.",
    "I'm sorry, I didn't understand the question; could you repeat it?",
    "The cat sleeps on the windowsill whenever the sun comes out.",
    "We need three more chairs for the guests tonight.",
    "The concert was cancelled because the singer was ill.",
    "Their flight lands at half past seven in the evening.",
    "I've lost my keys again; have you seen them anywhere?",
    "The river is too cold for swimming in April.",
    "Thank you for your help; I really appreciate it.",
)
_FRENCH = _rows(
    "sentence",
    "Nous allons au marché tous les samedis matin.",
    "Le musée ouvre ses portes à neuf heures.",
    "Mon frère travaille dans un hôpital depuis deux ans.",
    "Il fait trop chaud pour courir cet après-midi.",
    "Peux-tu m'envoyer l'adresse du restaurant ?",
    "Les enfants ont peint des oiseaux sur le mur de l'école.",
    "J'ai oublié mon parapluie dans le train.",
    "Cette boulangerie ferme à midi le dimanche.",
    "Nous avons visité un château au bord de la Loire.",
    "Elle lit un roman policier chaque soir avant de dormir.",
)
_SPANISH = _rows(
    "sentence",
    "Mañana vamos a la playa si no llueve.",
    "¿Dónde puedo comprar billetes para el autobús?",
    "Mi abuela hace la mejor tortilla de la familia.",
    "El tren llegó con media hora de retraso.",
    "Necesito aprender a cocinar algo más que pasta.",
    "Los sábados juego al fútbol con mis amigos.",
    "La tienda de la esquina abre a las ocho.",
    "Hemos pintado la cocina de color amarillo.",
    "¿Te apetece ir al cine esta noche?",
    "Mi perro tiene miedo de las tormentas.",
)
_GERMAN = _rows(
    "sentence",
    "Ich habe meinen Schlüssel im Büro vergessen.",
    "Der Zug nach Hamburg fährt von Gleis drei ab.",
    "Wir wandern jeden Sommer in den Bergen.",
    "Kannst du mir bitte das Salz geben?",
    "Meine Schwester studiert Medizin in Wien.",
    "Am Wochenende backen wir zusammen einen Kuchen.",
    "Das Konzert beginnt um acht Uhr abends.",
    "Im Winter fahren viele Leute in den Alpen Ski.",
    "Ich trinke morgens immer eine Tasse Tee.",
    "Unser Nachbar repariert gern alte Fahrräder.",
)
#: ``(topic, said, request, obstacle)``: an earlier exchange with the assistant, for follow-ups.
_THREADS = _rows(
    "topic said request obstacle",
    (
        "sleeping better",
        "Keeping the bedroom cool and dark helps you fall asleep faster.",
        "turn that into a short evening routine",
        "my flatmate works night shifts and keeps the lights on",
    ),
    (
        "saving for a holiday",
        "Putting a fixed amount aside on payday works better than saving whatever is left at the end.",
        "work out how much to set aside each week for a 1,200-euro trip in eight months",
        "my income changes a lot from month to month",
    ),
    (
        "learning Spanish",
        "Watching series with Spanish subtitles helps you pick up everyday phrases.",
        "suggest a weekly plan that mixes series, vocabulary and speaking",
        "I only have twenty minutes a day",
    ),
    (
        "growing herbs on a balcony",
        "Basil needs at least six hours of sun a day.",
        "recommend three herbs that cope with less light",
        "my balcony faces north",
    ),
    (
        "preparing a presentation",
        "Practising out loud three times is more useful than rereading the slides.",
        "give me a checklist for the day before",
        "I get very nervous and forget what to say",
    ),
    (
        "running a first 5K",
        "Alternating one minute of running with one minute of walking is a good way to start.",
        "make a six-week schedule out of it",
        "my knees start to hurt after ten minutes",
    ),
    (
        "decluttering a flat",
        "Sorting one small area at a time is less overwhelming than tackling a whole room.",
        "give me a plan for the kitchen",
        "I feel guilty throwing away presents",
    ),
    (
        "cooking for a family on a budget",
        "A big pot of lentil stew made on Sunday can cover several lunches.",
        "suggest four more dishes that work the same way",
        "my children refuse to eat lentils",
    ),
    (
        "choosing a laptop for university",
        "For writing essays and browsing, 8 GB of memory is usually enough.",
        "compare that with what video editing would need",
        "my course includes some 3D design",
    ),
    (
        "writing a cover letter",
        "Opening with a specific achievement is stronger than a generic first line.",
        "help me rewrite my first sentence",
        "I have never had a full-time job",
    ),
    (
        "keeping an indoor cat busy",
        "Ten minutes of play with a feather toy twice a day can reduce boredom.",
        "suggest games that use things I already have at home",
        "I work long hours and am rarely home at midday",
    ),
    (
        "cutting down on screen time",
        "Switching the phone display to greyscale makes it less tempting.",
        "list a few more small tricks like that",
        "I need my phone for work messages in the evening",
    ),
    (
        "a road trip through Scotland",
        "The drive from Edinburgh to Inverness takes about three and a half hours.",
        "build a five-day route with overnight stops",
        "I don't like driving more than two hours a day",
    ),
    (
        "making friends after a move",
        "Joining a weekly club gives you repeated contact with the same people.",
        "suggest clubs for someone who doesn't like sport",
        "I'm quite shy in big groups",
    ),
    (
        "revising for a chemistry exam",
        "Testing yourself with flashcards beats highlighting your notes.",
        "make flashcards on the main types of chemical bond",
        "I have only four days left",
    ),
    (
        "slow home internet",
        "Moving the router off the floor and away from thick walls often improves the signal.",
        "explain what else I can check",
        "the router has to stay in the hallway cupboard",
    ),
    (
        "starting a vegetable patch",
        "Raised beds warm up earlier in spring and drain better.",
        "tell me what to plant in the first year",
        "the soil in my garden is heavy clay",
    ),
    (
        "running a group project",
        "Agreeing on deadlines at the first meeting avoids most arguments later.",
        "draft a message I can send to the group",
        "one member never answers messages",
    ),
    (
        "drinking less coffee",
        "Cutting back by one cup per week is easier than stopping all at once.",
        "plan a gradual schedule for me",
        "I get headaches in the afternoon",
    ),
    (
        "teaching a child to ride a bike",
        "Taking the pedals off at first lets the child focus on balance.",
        "describe the next steps after that",
        "we live on a steep street",
    ),
)

_POOLS: dict[str, tuple[Row, ...]] = {
    "passages": PASSAGES,
    "documents": DOCUMENTS,
    "stories": _STORY_SUBJECTS,
    "products": _PRODUCTS,
    "occasions": _OCCASIONS,
    "opinions": _OPINIONS,
    "letters": _LETTERS,
    "personas": _PERSONAS,
    "support": _SUPPORT,
    "cities": _CITIES,
    "jobs": _JOBS,
    "events": _EVENTS,
    "correlations": _CORRELATIONS,
    "relations": _RELATIONS,
    "fermi": _FERMI,
    "dilemmas": _DILEMMAS,
    "sequences": _SEQUENCES,
    "items": _ITEMS,
    "places": _PLACES,
    "py_tasks": _PY_TASKS,
    "sql": _SQL,
    "snippets": _SNIPPETS,
    "buggy": _BUGGY,
    "concepts": _CONCEPTS,
    "pairs": _PAIRS,
    "processes": _PROCESSES,
    "phenomena": _PHENOMENA,
    "history": _HISTORY,
    "thinkers": _THINKERS,
    "inventions": _INVENTIONS,
    "movements": _MOVEMENTS,
    "ethics": _ETHICS,
    "terms": _TERMS,
    "english": _ENGLISH,
    "french": _FRENCH,
    "spanish": _SPANISH,
    "german": _GERMAN,
    "threads": _THREADS,
}


# --------------------------------------------------------------------------------------- templates
@dataclass(frozen=True)
class InstructTemplate:
    """One template of :func:`load_instruct`.

    Attributes:
        category: one of :data:`INSTRUCT_CATEGORIES`.
        text: a :meth:`str.format` string over the pool's fields and the drawn fields of
            :func:`_draw` (names and numbers).
        pool: the filler pool (a key of ``_POOLS``).
        offset: the first pool item used; ``count`` items follow, wrapping around the pool.
        count: how many prompts the template makes.
    """

    category: str
    text: str
    pool: str
    offset: int = 0
    count: int = 10


_T = InstructTemplate

#: The templates of :func:`load_instruct`, grouped by category (79 in all, 6 to 8 per category).
INSTRUCT_TEMPLATES = (
    # writing
    _T("writing", "Write a short story of about 200 words about {subject}.", "stories", 0),
    _T(
        "writing",
        "Write a poem of three four-line stanzas about {subject}, ending on a hopeful note.",
        "stories",
        10,
    ),
    _T(
        "writing",
        "Write the opening paragraph of a novel about {subject}, in the present tense.",
        "stories",
        5,
    ),
    _T(
        "writing",
        "Write a product description for an online shop, under 120 words, for {product}. Mention two "
        "concrete benefits and one situation where it is useful.",
        "products",
    ),
    _T(
        "writing",
        "Write a short speech for {occasion}. Keep it warm and personal, about 200 words, and finish with "
        "a toast.",
        "occasions",
    ),
    _T(
        "writing",
        "Write a persuasive paragraph arguing that {opinion}. Then add one sentence a critic might say in "
        "reply.",
        "opinions",
    ),
    _T(
        "writing",
        "Write a polite but firm letter to {recipient} about {issue}. Sign it as {name}.",
        "letters",
    ),
    # roleplay
    _T(
        "roleplay",
        "You are {persona}. A visitor asks what a typical day is like for you. Stay in character and "
        "answer in the first person.",
        "personas",
        0,
    ),
    _T(
        "roleplay",
        "Let's play a game: you are {persona}, and I, {name}, have just become your apprentice. Greet me "
        "and give me my first three tasks, in character.",
        "personas",
        10,
    ),
    _T(
        "roleplay",
        "Pretend to be {persona} writing a letter to an old friend named {friend} about the most "
        "surprising thing that happened this week.",
        "personas",
        5,
    ),
    _T(
        "roleplay",
        'Act as a customer support agent for {company}. A customer called {name} writes: "{complaint}" '
        "Reply helpfully and politely.",
        "support",
    ),
    _T(
        "roleplay",
        "You are a friendly tour guide in {city}. I have only {hours} hours. Plan a walking route and "
        "describe it to me as you would to your tour group.",
        "cities",
    ),
    _T(
        "roleplay",
        "Act as a hiring manager interviewing me for a job as {job}. Introduce yourself, then ask me your "
        "first three questions.",
        "jobs",
    ),
    # reasoning
    _T(
        "reasoning",
        "{name}, {friend} and {third} took part in a {event}. {name} did not finish last. {friend} "
        "finished directly behind {third}. There were no ties. In what order did they finish? Explain "
        "your reasoning.",
        "events",
    ),
    _T(
        "reasoning",
        'A report notes: "{observation}" Someone concludes that {conclusion}. What is wrong with this '
        "reasoning, what else could explain the pattern, and how could it be tested?",
        "correlations",
    ),
    _T(
        "reasoning",
        "{name} is twice as old as {friend}, {name}'s {relation}. In {k} years the sum of their ages will "
        "be {age_sum}. How old are they now? Show each step.",
        "relations",
    ),
    _T(
        "reasoning",
        "Estimate {question}. State your assumptions and show the calculation; a rough order of magnitude "
        "is fine.",
        "fermi",
    ),
    _T(
        "reasoning",
        "I have to choose between {option} and {other}. Walk through the trade-offs step by step and say "
        "which you would pick, and under what conditions.",
        "dilemmas",
    ),
    _T(
        "reasoning",
        "What are the next two numbers in the sequence {seq}, ...? Explain the rule you found.",
        "sequences",
    ),
    # math
    _T(
        "math",
        "{name} buys {a} {item} at {p} dollars each and pays with {bill} dollars in cash. How much change "
        "should {name} get back? Show your working.",
        "items",
        0,
    ),
    _T(
        "math",
        "A shop sells {item} for {price} euros each. In a sale the price drops by {pct}%, and members get "
        "a further {pct2}% off the sale price. What does a member pay for {b} {item}? Is that the same as "
        "a single {pct_sum}% discount? Explain.",
        "items",
        10,
    ),
    _T(
        "math",
        "{name} can pack {a} {item} per minute and {friend} can pack {b} per minute. Working together, "
        "how many minutes do they need to pack {n_pack} {item}? Explain step by step.",
        "items",
        5,
    ),
    _T(
        "math",
        "{name} and {friend} share {n_ratio} {item} in the ratio {r1}:{r2}. How many does each of them get, "
        "and how many more does one get than the other?",
        "items",
        15,
    ),
    _T(
        "math",
        "{name} has {a} more {item} than {friend}. Together they have {n_alg}. How many does each have? "
        "Set up an equation and solve it.",
        "items",
        3,
    ),
    _T(
        "math",
        "A market stall sold these numbers of {item} on {d} days in a row: {series}. Find the mean, the "
        "median and the range, and say on which day it sold the most.",
        "items",
        12,
    ),
    _T(
        "math",
        "A box holds {a} red, {b} blue and {c} green {item}. You take out two at random without putting "
        "the first one back. What is the probability that both are the same colour?",
        "items",
        7,
    ),
    _T(
        "math",
        "A rectangular {place} measures {length} m by {width} m. A path {path} m wide runs around its "
        "outside edge. What is the area of the path, and what is the perimeter of the outer edge?",
        "places",
    ),
    # coding
    _T(
        "coding",
        "Write a Python function that {task}. Include a docstring and two example calls.",
        "py_tasks",
        0,
    ),
    _T(
        "coding",
        "Write a JavaScript function that {task}. Explain how it handles empty input.",
        "py_tasks",
        8,
    ),
    _T(
        "coding",
        "I need a Python function that {task}. Please add type hints and three pytest test cases.",
        "py_tasks",
        16,
    ),
    _T("coding", "Given the table(s) {schema}, write an SQL query that {task}.", "sql"),
    _T(
        "coding",
        "Explain what this Python code does, line by line, and suggest one improvement:\n\n```python\n"
        "{code}\n```",
        "snippets",
    ),
    _T(
        "coding",
        "Rewrite this Python code in idiomatic JavaScript and point out any behaviour that differs:\n\n"
        "```python\n{code}\n```",
        "snippets",
        5,
    ),
    _T(
        "coding",
        "This function has a bug. Find it, explain it and give a corrected version:\n\n"
        "```python\n{code}\n```",
        "buggy",
    ),
    # extraction
    _T(
        "extraction",
        "List every date, name and number mentioned in the text below, each with a few words of "
        "context.\n\n{passage}",
        "passages",
        3,
    ),
    _T(
        "extraction",
        'Extract the information in this paragraph as a JSON object with the keys "topic", "people", '
        '"places", "dates" and "numbers".\n\n{passage}',
        "passages",
        8,
    ),
    _T(
        "extraction",
        "Turn the following text into a Markdown table with one row per fact (columns: fact, value).\n\n"
        "{passage}",
        "passages",
        13,
    ),
    _T(
        "extraction",
        "Find all the proper nouns in this passage and say whether each one is a person, a place, an "
        "organisation or something else.\n\n{passage}",
        "passages",
        18,
    ),
    _T(
        "extraction",
        "From the paragraph below, pull out every quantity together with its unit or what it counts, in "
        "the order they appear.\n\n{passage}",
        "passages",
        23,
    ),
    _T(
        "extraction",
        "Extract {fields} from the {doctype} below and return them as a JSON object.\n\n{doc}",
        "documents",
    ),
    _T(
        "extraction",
        "Rewrite the key facts of this {doctype} as a bulleted list, one fact per line, without adding "
        "anything.\n\n{doc}",
        "documents",
        8,
    ),
    # stem
    _T("stem", "Explain {concept} to a high-school student, using one everyday analogy.", "concepts", 0),
    _T("stem", "What is a common misconception about {concept}, and what is actually true?", "concepts", 10),
    _T(
        "stem",
        "Describe a simple experiment or model a student could build at home to understand {concept}. "
        "List the materials and the steps.",
        "concepts",
        5,
    ),
    _T("stem", "What is the difference between {x} and {y}? Give an example of each.", "pairs"),
    _T("stem", "Walk me through, step by step, how {process}.", "processes"),
    _T(
        "stem",
        "Why {phenomenon}? Give a one-sentence answer first, then a more detailed explanation.",
        "phenomena",
    ),
    # humanities
    _T("humanities", "What were the main causes and consequences of {event}?", "history"),
    _T(
        "humanities",
        "Summarise the main ideas of {thinker} and explain why they still matter today.",
        "thinkers",
    ),
    _T("humanities", "How did {invention} change everyday life and society?", "inventions"),
    _T(
        "humanities",
        "Compare {m1} and {m2}: what ideas drove each, and how can you recognise their works?",
        "movements",
    ),
    _T(
        "humanities",
        "Consider this question: {question} Present the strongest case on each side, then give a balanced "
        "conclusion.",
        "ethics",
    ),
    _T(
        "humanities",
        "What does {term} mean in {field}? Explain it with a real-world example.",
        "terms",
    ),
    # translation
    _T("translation", "Translate into French: {sentence}", "english", 0),
    _T("translation", 'How would I say this in Spanish? "{sentence}"', "english", 10),
    _T(
        "translation",
        "Please translate the following sentence into German, keeping the tone polite: {sentence}",
        "english",
        20,
    ),
    _T(
        "translation",
        'Give a natural French translation of "{sentence}", then explain any word choice that differs '
        "from a literal translation.",
        "english",
        15,
    ),
    _T("translation", "Translate this sentence into Spanish and then into German: {sentence}", "english", 5),
    _T("translation", "Translate this French sentence into English: {sentence}", "french"),
    _T("translation", 'What does this Spanish sentence mean in English? "{sentence}"', "spanish"),
    _T(
        "translation",
        "Translate from German into English, then list the verbs with their infinitives: {sentence}",
        "german",
    ),
    # summarization
    _T("summarization", "Summarize the following paragraph in one sentence:\n\n{passage}", "passages", 0),
    _T("summarization", "Give me a three-bullet summary of this text:\n\n{passage}", "passages", 5),
    _T(
        "summarization",
        "Write a headline and a two-sentence summary for this paragraph:\n\n{passage}",
        "passages",
        10,
    ),
    _T(
        "summarization",
        "Explain the following passage to a ten-year-old in simpler words, keeping only the main points:"
        "\n\n{passage}",
        "passages",
        15,
    ),
    _T(
        "summarization",
        "Condense this text into a social media post of at most 280 characters:\n\n{passage}",
        "passages",
        20,
    ),
    _T(
        "summarization",
        "What is the single most important takeaway from this paragraph? Answer in under 30 words.\n\n"
        "{passage}",
        "passages",
        25,
    ),
    # qa
    _T(
        "qa",
        "Read the passage and answer the question.\n\nPassage: {passage}\n\nQuestion: {question}",
        "passages",
        1,
    ),
    _T("qa", "{passage}\n\nAccording to the passage above: {question}", "passages", 6),
    _T(
        "qa",
        'Is this statement true, false or not stated in the text below? "{claim}" Explain briefly.\n\n'
        "{passage}",
        "passages",
        11,
    ),
    _T(
        "qa",
        "Context: {passage}\n\nUsing only the context, answer: {question} If the context does not say, "
        "reply that it is not stated.",
        "passages",
        16,
    ),
    _T(
        "qa",
        "Here is a paragraph:\n\n{passage}\n\nWrite three questions that it answers, and answer each one.",
        "passages",
        21,
    ),
    _T(
        "qa",
        'Which sentence of the passage below best answers the question "{question}" Quote it and explain.'
        "\n\n{passage}",
        "passages",
        26,
    ),
    # conversation
    _T(
        "conversation",
        'Earlier you told me: "{said}" Can you explain why that is true, with an everyday example?',
        "threads",
        0,
    ),
    _T(
        "conversation",
        'Last time we talked about {topic}, you said: "{said}" Could you {request}?',
        "threads",
        10,
    ),
    _T(
        "conversation",
        "User: Can you help me with {topic}?\nAssistant: Of course. {said}\nUser: Thanks! Now please "
        "{request}.",
        "threads",
        5,
    ),
    _T(
        "conversation",
        'You mentioned before: "{said}" I tried that, but it didn\'t work for me because {obstacle}. What '
        "else can I try?",
        "threads",
        15,
    ),
    _T(
        "conversation",
        'Quick recap of our earlier chat about {topic}: you said "{said}" Can you turn that into a short '
        "checklist I can stick on my fridge?",
        "threads",
        2,
    ),
    _T(
        "conversation",
        'Following up on our conversation about {topic}: you said "{said}" I forgot to mention that '
        "{obstacle}. Does that change your advice? If so, please {request} with that in mind.",
        "threads",
        12,
    ),
)

#: The categories of :func:`load_instruct`, in the order the round-robin visits them.
INSTRUCT_CATEGORIES = tuple(dict.fromkeys(t.category for t in INSTRUCT_TEMPLATES))

_NAMES = (
    "Amara",
    "Jonas",
    "Mei",
    "Diego",
    "Fatima",
    "Henrik",
    "Zanele",
    "Ravi",
    "Chloe",
    "Kenji",
    "Ines",
    "Malik",
    "Olga",
    "Tariq",
    "Hana",
    "Mateo",
    "Freya",
    "Kwame",
    "Lucia",
    "Arjun",
    "Elif",
    "Samuel",
    "Nadia",
    "Pablo",
)

_RATIOS = ((1, 2), (2, 3), (3, 4), (2, 5), (3, 5), (1, 3), (4, 5), (5, 7))


def _draw(rng: random.Random) -> dict[str, Any]:
    """The names and numbers of one prompt (every field every time, so the draws stay aligned)."""
    name, friend, third = rng.sample(_NAMES, 3)
    a, b, c, k = rng.randint(3, 12), rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 9)
    p = rng.randint(2, 9)
    pct, pct2 = rng.choice((10, 15, 20, 25, 30, 40)), rng.choice((5, 10, 15, 20))
    r1, r2 = rng.choice(_RATIOS)
    age = rng.randint(4, 15)
    d = rng.randint(5, 7)
    series = ", ".join(str(rng.randint(8, 60)) for _ in range(d))
    return {
        "name": name,
        "friend": friend,
        "third": third,
        "a": a,
        "b": b,
        "c": c,
        "k": k,
        "p": p,
        "bill": 10 * ((a * p) // 10 + 1 + rng.randint(0, 2)),
        "price": rng.randint(12, 95),
        "pct": pct,
        "pct2": pct2,
        "pct_sum": pct + pct2,
        "n_pack": (a + b) * k,
        "r1": r1,
        "r2": r2,
        "n_ratio": (r1 + r2) * rng.randint(3, 12),
        "n_alg": 2 * c + a,
        "age_sum": 3 * age + 2 * k,
        "d": d,
        "series": series,
        "length": rng.randint(8, 30),
        "width": rng.randint(5, 20),
        "path": rng.choice((1, 1.5, 2)),
        "hours": rng.randint(2, 6),
    }


def load_instruct(limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Deterministic instruction prompts (790): every :data:`INSTRUCT_TEMPLATES` entry filled with its
    10 pool items, names and numbers drawn with ``random.Random(seed)``, in round-robin order over
    :data:`INSTRUCT_CATEGORIES` and, within a category, over its templates (so the first ``limit`` are
    a stratified sample).

    Ids are ``instruct/<category>/<template index>/<slug of the pool item's key>``; they do not depend
    on ``seed``.
    """
    rng = random.Random(seed)
    made: list[tuple[int, int, Prompt]] = []
    for i, t in enumerate(INSTRUCT_TEMPLATES):
        pool = _POOLS[t.pool]
        for j in range(t.count):
            item = pool[(t.offset + j) % len(pool)]
            fields = _draw(rng)
            fields.update({key: value(rng) if callable(value) else value for key, value in item.items()})
            key = next(iter(item.values()))
            content = t.text.format(**fields)
            made.append((j, i, Prompt(f"instruct/{t.category}/{i}/{_slug(key)}", t.category, _user(content))))
    made.sort(key=lambda m: (m[0], m[1]))  # within a category: interleave its templates
    prompts = round_robin(p for _, _, p in made)
    return prompts if limit is None else prompts[:limit]


# ------------------------------------------------------------------------------------ fresh chat
#: Everyday chat requests written by hand, for evaluation only (never for training).
FRESH_CHAT = (
    "I've got chicken thighs, a can of chickpeas, spinach and some feta. What could I make for dinner "
    "tonight that takes under 40 minutes?",
    "My partner and I have four days in Portugal in early November. Should we split the time between "
    "two cities or just stay put in one?",
    "I just got my first real paycheck. How should I divide it between rent, savings and fun money so "
    "I'm not broke by the end of the month?",
    "I keep waking up at 3 a.m. and can't drift off again. What might be causing it and what could I try?",
    "My best friend hasn't texted me back in two weeks and I'm worried I did something wrong. How do I "
    "bring it up without sounding needy?",
    "My laptop fan is super loud all the time, even with just a browser open. What can I check before "
    "taking it in for repair?",
    "Can you help me understand why dividing by a fraction is the same as multiplying by its reciprocal? "
    "My daughter asked and I totally blanked.",
    "Need a birthday present idea for my dad who's turning 60. He's into fishing, old westerns and "
    "barbecues, and already owns way too many gadgets.",
    "What's a good way to start stretching if I sit at a desk all day? My lower back is getting stiff.",
    "Is it rude to bring a store-bought dessert to a dinner party when the host said to just bring yourself?",
    "I want to learn to touch type. How long does it realistically take, and what's the best way to "
    "practise?",
    "How do I get my toddler to eat vegetables without it turning into a battle every night?",
    "We're thinking about putting solar panels on our roof. What should I ask installers before signing "
    "anything?",
    "My homemade pizza dough always tears when I stretch it. Any idea what I'm doing wrong?",
    "Could you explain what an index fund is, like I'm someone who has never invested a cent?",
    "I'm visiting Tokyo for the first time next spring. What etiquette mistakes do tourists usually make "
    "there?",
    "My phone storage is full again. What's the easiest way to free up space without losing my photos?",
    "How can I politely tell a coworker that their loud phone calls make it hard for me to concentrate?",
    "I have a video interview on Thursday. Any tips for looking and sounding good on camera?",
    "What's the difference between a Roth IRA and a traditional IRA, in plain English?",
    "Can you suggest a cozy vegetarian soup that freezes well? I like to batch cook on Sundays.",
    "My teenage son wants to quit piano after six years of lessons. How do I figure out whether to let him?",
    "Honestly, how often should I be washing my jeans?",
    "My in-laws are staying with us for a week in a tiny apartment. Any tips for keeping everyone sane?",
    "Why does my pothos have yellow leaves with brown tips? It sits next to a north-facing window.",
    "My brother asked me to give a toast at his wedding, but everything I write sounds cheesy. How do I "
    "make it heartfelt without being corny?",
    "Which keeps me full longer until lunch, overnight oats or a fruit smoothie?",
    "Can you explain how a bill becomes a law in the US? I have a civics quiz tomorrow morning.",
    "What are some fun things to do on a rainy weekend with two kids under eight who are sick of screens?",
    "I made a budget spreadsheet but I never stick to it. What habits actually make budgeting work?",
    "Our Wi-Fi drops every evening around 8. Could the neighbours' networks be interfering, and how "
    "would I tell?",
    "I'd like to ask my manager for a raise after two years in my role. How should I prepare for that "
    "conversation?",
)


def load_fresh_chat(limit: int | None = None) -> list[Prompt]:
    """:data:`FRESH_CHAT` as prompts (category ``fresh``, ids ``fresh/<index>/<slug of first words>``),
    in order; the first ``limit`` when given. For evaluation only, never for training."""
    prompts = [
        Prompt(f"fresh/{i}/{_slug(text, 5)}", "fresh", _user(text)) for i, text in enumerate(FRESH_CHAT)
    ]
    return prompts if limit is None else prompts[:limit]
